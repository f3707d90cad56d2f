//! The KV cache of one window: F16 K and V per layer, cut into fixed slots, one per live
//! sequence. Position p of a sequence lives in cell p of its slot, so a sequence's cache
//! is one contiguous span (attention reads a plain view of it) and truncating it for a
//! speculative rollback or a prompt-cache reuse is just moving its length back.

use std::collections::HashMap;

use llama_cpp_sys_2 as sys;

use crate::ggml::{self, Device};
use crate::model::ModelSpec;
use crate::{Error, Result};

/// Sequence ids are the caller's (request ids, ring-wide sequence numbers); slots are
/// assigned on first use and freed by `clear`.
pub type SeqId = u64;

/// llama.cpp pads the attended KV length to a multiple of 256 cells (`get_n_kv`); doing
/// the same keeps attention shapes, and so its floating-point order, identical.
pub const KV_PAD: usize = 256;

/// Per-layer K/V tensors of a window.
pub struct LayerKv {
    pub k: *mut sys::ggml_tensor,
    pub v: *mut sys::ggml_tensor,
}

pub struct KvCache {
    pub layers: Vec<LayerKv>,
    /// Cells per slot: the per-sequence context, rounded up to `KV_PAD`.
    pub slot_cells: usize,
    /// Usable cells per sequence (the configured context size).
    pub capacity: usize,
    slots: Vec<Option<SeqId>>,
    seqs: HashMap<SeqId, SeqState>,
    /// Everything this value allocated in ggml, freed when it drops.
    alloc: crate::ggml::Allocations,
}

unsafe impl Send for KvCache {}

#[derive(Debug, Clone, Copy)]
pub struct SeqState {
    pub slot: usize,
    pub len: usize,
}

impl KvCache {
    /// `devices[i]` is where layer i of the window runs; its cache goes there too.
    pub fn new(spec: &ModelSpec, devices: &[Device], n_seq: usize, n_ctx_seq: usize, accel: Option<&ggml::Accelerator>) -> Result<KvCache> {
        if n_seq == 0 || n_ctx_seq == 0 {
            return Err(Error::InvalidWindow("the KV cache needs at least one sequence of at least one cell".into()));
        }
        let slot_cells = n_ctx_seq.div_ceil(KV_PAD) * KV_PAD;
        let total = slot_cells
            .checked_mul(n_seq)
            .filter(|&t| t <= i32::MAX as usize)
            .ok_or_else(|| Error::InvalidWindow(format!("{n_seq} sequences of {n_ctx_seq} cells is too large a KV cache")))?;
        let n_embd_kv = spec.n_embd_kv() as u64;
        let cpu_ctx = ggml::new_meta_context(devices.len() * 2)?;
        let accel_ctx = if devices.contains(&Device::Accelerator) { Some(ggml::new_meta_context(devices.len() * 2)?) } else { None };
        let mut layers = Vec::with_capacity(devices.len());
        for dev in devices {
            let ctx = match dev {
                Device::Accelerator => accel_ctx.expect("created when a layer is offloaded"),
                Device::Cpu => cpu_ctx,
            };
            let k = ggml::new_tensor(ctx, sys::GGML_TYPE_F16, &[n_embd_kv, total as u64])?;
            let v = ggml::new_tensor(ctx, sys::GGML_TYPE_F16, &[n_embd_kv, total as u64])?;
            layers.push(LayerKv { k, v });
        }
        let mut cache = KvCache {
            layers,
            slot_cells,
            capacity: n_ctx_seq,
            slots: vec![None; n_seq],
            seqs: HashMap::new(),
            alloc: crate::ggml::Allocations { contexts: [Some(cpu_ctx), accel_ctx].into_iter().flatten().collect(), buffers: Vec::new() },
        };
        // SAFETY: each context holds only this cache's tensors; the buffer types are the
        // CPU's and the accelerator's own.
        unsafe {
            let cpu = sys::ggml_backend_alloc_ctx_tensors_from_buft(cpu_ctx, sys::ggml_backend_cpu_buffer_type());
            if !cpu.is_null() {
                cache.alloc.buffers.push(cpu);
            }
            if let Some(actx) = accel_ctx {
                let accel = accel.ok_or_else(|| Error::Ggml("accelerator layers without an accelerator".into()))?;
                let b = sys::ggml_backend_alloc_ctx_tensors_from_buft(actx, accel.buffer_type);
                if b.is_null() {
                    return Err(Error::Ggml("could not allocate the KV cache in accelerator memory".into()));
                }
                cache.alloc.buffers.push(b);
            }
            if cache.alloc.buffers.is_empty() && devices.contains(&Device::Cpu) {
                return Err(Error::Ggml("could not allocate the KV cache".into()));
            }
            // Unwritten cells are masked out, but zeros keep NaN garbage out of any kernel
            // that multiplies before masking.
            for b in &cache.alloc.buffers {
                sys::ggml_backend_buffer_clear(*b, 0);
            }
        }
        Ok(cache)
    }

    pub fn n_slots(&self) -> usize {
        self.slots.len()
    }

    pub fn seq(&self, seq: SeqId) -> Option<SeqState> {
        self.seqs.get(&seq).copied()
    }

    pub fn len(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq).map_or(0, |s| s.len)
    }

    /// The slot a sequence would use, without committing it (a batch is planned first
    /// and committed only after it ran).
    pub fn slot_for(&self, seq: SeqId, taken: &[usize]) -> Result<usize> {
        if let Some(s) = self.seqs.get(&seq) {
            return Ok(s.slot);
        }
        self.slots
            .iter()
            .enumerate()
            .find(|(i, s)| s.is_none() && !taken.contains(i))
            .map(|(i, _)| i)
            .ok_or(Error::CacheFull { slots: self.slots.len() })
    }

    pub fn commit(&mut self, seq: SeqId, slot: usize, len: usize) {
        self.slots[slot] = Some(seq);
        self.seqs.insert(seq, SeqState { slot, len });
    }

    pub fn clear(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.remove(&seq) {
            self.slots[s.slot] = None;
        }
    }

    pub fn clear_all(&mut self) {
        self.seqs.clear();
        self.slots.iter_mut().for_each(|s| *s = None);
    }

    /// Keeps positions [0, len) of `seq`; later cells are forgotten.
    pub fn truncate(&mut self, seq: SeqId, len: usize) {
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.len = s.len.min(len);
        }
    }
}
