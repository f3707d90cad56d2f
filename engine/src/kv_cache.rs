//! The KV cache of one window: K and V per layer (F16 unless asked otherwise: see
//! [`CacheType`]), cut into fixed slots, one per live sequence. Position p of a sequence lives in cell p of its slot, so a sequence's cache
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

/// The element type of the K or V cache: what llama.cpp's `--cache-type-k` and
/// `--cache-type-v` accept. A quantized cache is written by `set_rows` (each new token's
/// row quantized as it lands) and read by flash attention as it is, so a `q8_0` cache
/// takes 53% of F16's bytes and `q4_0` 28%, for a little precision: what lets a small
/// device hold a long context or more layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheType {
    F32,
    #[default]
    F16,
    Bf16,
    Q8_0,
    Q4_0,
    Q4_1,
    Iq4Nl,
    Q5_0,
    Q5_1,
}

impl CacheType {
    pub const ALL: [CacheType; 9] = [CacheType::F32, CacheType::F16, CacheType::Bf16, CacheType::Q8_0, CacheType::Q4_0, CacheType::Q4_1, CacheType::Iq4Nl, CacheType::Q5_0, CacheType::Q5_1];

    /// The name llama.cpp's flags use (`q8_0`, `iq4_nl`, …).
    pub fn name(self) -> &'static str {
        match self {
            CacheType::F32 => "f32",
            CacheType::F16 => "f16",
            CacheType::Bf16 => "bf16",
            CacheType::Q8_0 => "q8_0",
            CacheType::Q4_0 => "q4_0",
            CacheType::Q4_1 => "q4_1",
            CacheType::Iq4Nl => "iq4_nl",
            CacheType::Q5_0 => "q5_0",
            CacheType::Q5_1 => "q5_1",
        }
    }

    pub fn ggml_type(self) -> sys::ggml_type {
        match self {
            CacheType::F32 => sys::GGML_TYPE_F32,
            CacheType::F16 => sys::GGML_TYPE_F16,
            CacheType::Bf16 => sys::GGML_TYPE_BF16,
            CacheType::Q8_0 => sys::GGML_TYPE_Q8_0,
            CacheType::Q4_0 => sys::GGML_TYPE_Q4_0,
            CacheType::Q4_1 => sys::GGML_TYPE_Q4_1,
            CacheType::Iq4Nl => sys::GGML_TYPE_IQ4_NL,
            CacheType::Q5_0 => sys::GGML_TYPE_Q5_0,
            CacheType::Q5_1 => sys::GGML_TYPE_Q5_1,
        }
    }

    /// Bytes of a row of `n` elements (`n` a multiple of the block size for a quantized
    /// type; see [`CacheType::fits`]).
    pub fn row_bytes(self, n: usize) -> usize {
        // SAFETY: a pure function of a valid type and a count.
        unsafe { sys::ggml_row_size(self.ggml_type(), n as i64) }
    }

    /// Bytes per element, for memory estimates (a q8_0 element is 34/32 bytes).
    pub fn bytes_per_element(self) -> f64 {
        let block = self.block();
        self.row_bytes(block) as f64 / block as f64
    }

    fn block(self) -> usize {
        // SAFETY: a pure function of a valid type.
        unsafe { sys::ggml_blck_size(self.ggml_type()) as usize }
    }

    /// Whether rows of `head_dim` elements cut into whole blocks of this type: each
    /// head's K and V are separate views of the cache row.
    pub fn fits(self, head_dim: usize) -> bool {
        head_dim % self.block() == 0
    }
}

impl std::fmt::Display for CacheType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CacheType {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<CacheType, String> {
        let lower = s.to_ascii_lowercase();
        CacheType::ALL.into_iter().find(|t| t.name() == lower).ok_or_else(|| {
            let names: Vec<&str> = CacheType::ALL.iter().map(|t| t.name()).collect();
            format!("unknown KV cache type {s:?}: one of {}", names.join(", "))
        })
    }
}

/// The K and V cache types of a stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct CacheTypes {
    #[serde(default)]
    pub k: CacheType,
    #[serde(default)]
    pub v: CacheType,
}

impl std::fmt::Display for CacheTypes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "K {}, V {}", self.k, self.v)
    }
}

impl CacheTypes {
    /// The sizes of the Walsh-Hadamard rotations applied around a quantized cache, as
    /// llama.cpp applies them (its `n_rot_k`, `n_rot_v`; 0: none). A rotation spreads each
    /// head's outliers over all its elements before they are quantized, so a 4-bit cache
    /// loses much less; being orthonormal and its own inverse, it changes nothing else:
    /// Q and K rotated alike give the same scores, and the attention output is rotated
    /// back from V's. K's rotation is the largest power of two dividing the head size
    /// (at least 64), V's 64; a head size that is not a multiple of 64 is not rotated.
    pub fn rotations(self, head_dim: usize) -> (usize, usize) {
        const MIN_ROTATION: usize = 64;
        let quantized = |t: CacheType| unsafe { sys::ggml_is_quantized(t.ggml_type()) };
        let rotated = |t: CacheType| quantized(t) && head_dim % MIN_ROTATION == 0;
        let mut k = 0;
        if rotated(self.k) {
            k = MIN_ROTATION;
            while head_dim % (2 * k) == 0 {
                k *= 2;
            }
        }
        (k, if rotated(self.v) { MIN_ROTATION } else { 0 })
    }

    /// Bytes of one cached token's K and V in one layer.
    pub fn bytes_per_token(self, n_embd_k: usize, n_embd_v: usize) -> usize {
        self.k.row_bytes(n_embd_k) + self.v.row_bytes(n_embd_v)
    }
}

/// The orthonormal Walsh-Hadamard matrix of size `n` (a power of two), row-major: entry
/// (i, j) is `(-1)^popcount(i & j) / sqrt(n)`, the Sylvester construction llama.cpp uses.
/// Made once per size and shared: every step of a quantized cache uploads it.
pub fn hadamard(n: usize) -> std::sync::Arc<[f32]> {
    static MADE: std::sync::Mutex<Vec<(usize, std::sync::Arc<[f32]>)>> = std::sync::Mutex::new(Vec::new());
    let mut made = MADE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, m)) = made.iter().find(|(size, _)| *size == n) {
        return m.clone();
    }
    // Computed as llama.cpp computes it (`1.0 / sqrtf(n)`: a double division), to the bit.
    let scale = (1.0f64 / f64::from((n as f32).sqrt())) as f32;
    let m: std::sync::Arc<[f32]> = (0..n * n).map(|x| if ((x / n) & (x % n)).count_ones() % 2 == 0 { scale } else { -scale }).collect();
    made.push((n, m.clone()));
    m
}

/// Copies row `row` of `src` to the same row of `dst` (two tensors of one shape).
///
/// SAFETY: both are allocated tensors of the same shape with at least `row + 1` rows, and
/// nothing computes on them.
unsafe fn copy_row(src: *mut sys::ggml_tensor, dst: *mut sys::ggml_tensor, row: usize) {
    let bytes = sys::ggml_row_size((*src).type_, (*src).ne[0]);
    copy_bytes(src, row * bytes, dst, row * bytes, bytes);
}

/// Copies `bytes` at byte `from` of `src` to byte `to` of `dst` (regions that do not
/// overlap, in one tensor or two): through host memory where either lives on an
/// accelerator.
///
/// SAFETY: both are allocated tensors holding their regions, and nothing computes on them.
unsafe fn copy_bytes(src: *mut sys::ggml_tensor, from: usize, dst: *mut sys::ggml_tensor, to: usize, bytes: usize) {
    if sys::ggml_backend_buffer_is_host((*src).buffer) && sys::ggml_backend_buffer_is_host((*dst).buffer) {
        std::ptr::copy_nonoverlapping((*src).data.cast::<u8>().add(from), (*dst).data.cast::<u8>().add(to), bytes);
    } else {
        let mut buf = vec![0u8; bytes];
        sys::ggml_backend_tensor_get(src, buf.as_mut_ptr().cast(), from, bytes);
        sys::ggml_backend_tensor_set(dst, buf.as_ptr().cast(), to, bytes);
    }
}

/// Per-layer K/V tensors of a window: null in a recurrent layer, which keeps `state`.
pub struct LayerKv {
    pub k: *mut sys::ggml_tensor,
    pub v: *mut sys::ggml_tensor,
    pub state: Option<RecurrentState>,
}

/// A recurrent layer's state, one f32 row per slot (llama.cpp keeps both in f32): the
/// convolution's last inputs `[conv_state_len, n_slots]` and the gated delta net's state
/// `[ssm_state_len, n_slots]`.
#[derive(Clone, Copy)]
pub struct RecurrentState {
    pub conv: *mut sys::ggml_tensor,
    pub ssm: *mut sys::ggml_tensor,
    /// With draft snapshots (`KvCache::new`'s `draft_snapshots`): the same rows again, where
    /// each sequence's state stood before the draft tokens of its last batch with drafts
    /// (`KvCache::snapshots` holds that length); null otherwise.
    pub snap_conv: *mut sys::ggml_tensor,
    pub snap_ssm: *mut sys::ggml_tensor,
}

impl RecurrentState {
    pub fn has_snapshots(&self) -> bool {
        !self.snap_conv.is_null()
    }
}

/// A copy of one sequence's recurrent state in every recurrent layer of a window, taken
/// when the sequence held `len` positions: what lets a sequence go back to `len` (a
/// recurrent state cannot be truncated, only restored).
struct Checkpoint {
    len: usize,
    /// The state as [`KvCache::read_state`] gives it.
    data: Vec<u8>,
}

/// Checkpoints kept per sequence (the most recent): a turn's prompt end and a few before.
const CHECKPOINTS_PER_SEQUENCE: usize = 4;

pub struct KvCache {
    /// Per layer; under MLA each layer's `v` is its `k` (see `v_in_k`). A layer that
    /// attends with a donor's cache (`ModelSpec::kv_donor`) holds the donor's tensors, or
    /// its shadow's.
    pub layers: Vec<LayerKv>,
    /// Copies of donor layers' caches this window attends with but does not compute
    /// (donor layer, tensors): each batch writes them from the K/V its input carries.
    pub shadows: Vec<(usize, LayerKv)>,
    /// MLA: V is the first this-many elements of each K row, not a cache of its own.
    pub v_in_k: Option<usize>,
    pub types: CacheTypes,
    /// Cells per slot: the per-sequence context, rounded up to `KV_PAD`.
    pub slot_cells: usize,
    /// Usable cells per sequence (the configured context size).
    pub capacity: usize,
    slots: Vec<Option<SeqId>>,
    seqs: HashMap<SeqId, SeqState>,
    /// Whether the model has recurrent layers: then no window's sequences are truncated
    /// but to a checkpoint, so that every window (those without recurrent layers too, and
    /// every ring member) keeps the same length.
    pub recurrent: bool,
    checkpoints: HashMap<SeqId, Vec<Checkpoint>>,
    /// Whether recurrent states keep a snapshot where a batch's drafts begin
    /// (`RecurrentState::snap_conv`); every window of a recurrent model records the
    /// snapshot's length, with recurrent layers or not, so that all agree on truncation.
    pub draft_snapshots: bool,
    /// Per sequence, the length at which its snapshot rows hold its state (set by `commit`
    /// for a batch with draft tokens; dropped when the sequence is cut below it).
    snapshots: HashMap<SeqId, usize>,
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
    /// `layers[i]`: the model layer the window's i-th is and the device it runs on; its
    /// cache goes there too, as wide as that layer's K/V rows. `draft_snapshots`: a
    /// recurrent model's state is kept twice, so that draft tokens can be taken back (see
    /// `StageConfig::draft_snapshots`).
    pub fn new(spec: &ModelSpec, window: &[(usize, Device)], n_seq: usize, n_ctx_seq: usize, types: CacheTypes, accel: Option<&ggml::Accelerator>, draft_snapshots: bool) -> Result<KvCache> {
        if n_seq == 0 || n_ctx_seq == 0 {
            return Err(Error::InvalidWindow("the KV cache needs at least one sequence of at least one cell".into()));
        }
        // Under MLA V is part of the K rows: llama.cpp takes only one type for both.
        let v_cached = spec.mla.is_none();
        if !v_cached && types.k != types.v {
            return Err(Error::InvalidWindow(format!("this model's latent attention keeps V inside the K cache, so K and V take one cache type (K {}, V {}): set both to the same", types.k, types.v)));
        }
        for (which, t) in [("K", types.k), ("V", types.v)].into_iter().filter(|(w, _)| *w == "K" || v_cached) {
            for &(il, _) in window.iter().filter(|(il, _)| !spec.is_recurrent(*il)) {
                let hd = spec.head_dim_of(il);
                if !t.fits(hd) {
                    return Err(Error::InvalidWindow(format!("a {t} {which} cache needs a head size that is a multiple of {} (this model's is {hd})", t.block())));
                }
            }
        }
        let devices: Vec<Device> = window.iter().map(|&(_, d)| d).collect();
        let slot_cells = n_ctx_seq.div_ceil(KV_PAD) * KV_PAD;
        let total = slot_cells
            .checked_mul(n_seq)
            .filter(|&t| t <= i32::MAX as usize)
            .ok_or_else(|| Error::InvalidWindow(format!("{n_seq} sequences of {n_ctx_seq} cells is too large a KV cache")))?;
        let cpu_ctx = ggml::new_meta_context(devices.len() * 4 + 1)?;
        let accel_ctx = if devices.contains(&Device::Accelerator) { Some(ggml::new_meta_context(devices.len() * 4 + 1)?) } else { None };
        let recurrent = (0..spec.n_layer).any(|il| spec.is_recurrent(il));
        let draft_snapshots = draft_snapshots && recurrent;
        let v_in_k = spec.mla.map(|m| m.kv_lora_rank);
        let mut layers: Vec<LayerKv> = Vec::with_capacity(devices.len());
        let mut shadows: Vec<(usize, LayerKv)> = Vec::new();
        for &(il, dev) in window {
            let n_embd_kv = spec.n_embd_kv_of(il) as u64;
            let ctx = match dev {
                Device::Accelerator => accel_ctx.expect("created when a layer is offloaded"),
                Device::Cpu => cpu_ctx,
            };
            if let Some(d) = spec.kv_donor(il) {
                // The donor's own cache when it is in this window, else this window's copy
                // of it, written from the K/V the hidden states carry.
                let (k, v) = match window.iter().position(|&(l, _)| l == d) {
                    Some(i) => (layers[i].k, layers[i].v),
                    None => match shadows.iter().find(|(l, _)| *l == d) {
                        Some((_, s)) => (s.k, s.v),
                        None => {
                            let w = spec.n_embd_kv_of(d) as u64;
                            let k = ggml::new_tensor(ctx, types.k.ggml_type(), &[w, total as u64])?;
                            let v = ggml::new_tensor(ctx, types.v.ggml_type(), &[w, total as u64])?;
                            shadows.push((d, LayerKv { k, v, state: None }));
                            (k, v)
                        }
                    },
                };
                layers.push(LayerKv { k, v, state: None });
                continue;
            }
            if let Some(r) = spec.recurrent.as_ref().filter(|_| spec.is_recurrent(il)) {
                let rows = |len: usize| ggml::new_tensor(ctx, sys::GGML_TYPE_F32, &[len as u64, n_seq as u64]);
                let (conv, ssm) = (rows(r.conv_state_len())?, rows(r.ssm_state_len())?);
                let (snap_conv, snap_ssm) = if draft_snapshots { (rows(r.conv_state_len())?, rows(r.ssm_state_len())?) } else { (std::ptr::null_mut(), std::ptr::null_mut()) };
                layers.push(LayerKv { k: std::ptr::null_mut(), v: std::ptr::null_mut(), state: Some(RecurrentState { conv, ssm, snap_conv, snap_ssm }) });
                continue;
            }
            let k = ggml::new_tensor(ctx, types.k.ggml_type(), &[n_embd_kv, total as u64])?;
            // Under MLA, V is read from the K rows: no V cache of its own.
            let v = if spec.n_embd_v_cache_of(il) == 0 { k } else { ggml::new_tensor(ctx, types.v.ggml_type(), &[n_embd_kv, total as u64])? };
            layers.push(LayerKv { k, v, state: None });
        }
        let mut cache = KvCache {
            layers,
            shadows,
            v_in_k,
            types,
            slot_cells,
            capacity: n_ctx_seq,
            slots: vec![None; n_seq],
            seqs: HashMap::new(),
            recurrent,
            checkpoints: HashMap::new(),
            draft_snapshots,
            snapshots: HashMap::new(),
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

    /// Records a computed batch of `seq`: `len` positions now, and `snapshot`, the length
    /// at which the batch wrote the snapshot rows (a batch with draft tokens).
    pub fn commit(&mut self, seq: SeqId, slot: usize, len: usize, snapshot: Option<usize>) {
        self.slots[slot] = Some(seq);
        self.seqs.insert(seq, SeqState { slot, len });
        if let Some(at) = snapshot {
            self.snapshots.insert(seq, at);
        }
    }

    pub fn clear(&mut self, seq: SeqId) {
        if let Some(s) = self.seqs.remove(&seq) {
            self.slots[s.slot] = None;
        }
        self.checkpoints.remove(&seq);
        self.snapshots.remove(&seq);
    }

    pub fn clear_all(&mut self) {
        self.seqs.clear();
        self.slots.iter_mut().for_each(|s| *s = None);
        self.checkpoints.clear();
        self.snapshots.clear();
    }

    /// Keeps positions [0, len) of `seq`, later cells forgotten; returns the length kept.
    /// A recurrent window's state cannot be truncated: it goes back to the latest
    /// checkpoint or draft snapshot at or before `len` (the length kept then), or to
    /// nothing.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> usize {
        let Some(cur) = self.seqs.get(&seq).copied() else { return 0 };
        if len >= cur.len || !self.recurrent {
            let kept = cur.len.min(len);
            self.seqs.get_mut(&seq).expect("present").len = kept;
            return kept;
        }
        let back = self.checkpoints.get_mut(&seq).and_then(|cps| {
            cps.retain(|c| c.len <= len);
            cps.last()
        });
        let snapshot = self.snapshots.get(&seq).copied().filter(|&at| at <= len && at > back.map_or(0, |c| c.len));
        if let Some(at) = snapshot {
            // SAFETY: the slot's rows of tensors this cache owns; nothing computes.
            unsafe {
                for st in self.layers.iter().filter_map(|l| l.state) {
                    copy_row(st.snap_conv, st.conv, cur.slot);
                    copy_row(st.snap_ssm, st.ssm, cur.slot);
                }
            }
            self.seqs.get_mut(&seq).expect("present").len = at;
            return at;
        }
        self.snapshots.remove(&seq);
        let kept = back.map_or(0, |c| c.len);
        if let Some(c) = back {
            let data = c.data.clone();
            self.write_state(cur.slot, &data);
        }
        self.seqs.get_mut(&seq).expect("present").len = kept;
        kept
    }

    /// Gives `to` the first `len` positions of `from` (at most what `from` holds), whatever
    /// `to` held before: the K/V rows of a prefix are the same whichever sequence computed
    /// them, so a prompt that starts with another sequence's tokens need not compute them
    /// again. Returns the positions copied: 0 for a model with recurrent layers (a state
    /// holds a sequence's whole past, not a prefix of it), an unknown `from`, or no free
    /// slot for a new `to`.
    pub fn copy_prefix(&mut self, from: SeqId, to: SeqId, len: usize) -> usize {
        let Some(src) = self.seqs.get(&from).copied() else { return 0 };
        let len = len.min(src.len);
        if self.recurrent || from == to || len == 0 {
            return 0;
        }
        let Ok(slot) = self.slot_for(to, &[]) else { return 0 };
        // SAFETY: rows of two different slots of tensors this cache owns; nothing computes
        // while the cache is borrowed mutably.
        unsafe {
            for t in self.row_tensors() {
                let row = sys::ggml_row_size((*t).type_, (*t).ne[0]);
                copy_bytes(t, src.slot * self.slot_cells * row, t, slot * self.slot_cells * row, len * row);
            }
        }
        self.checkpoints.remove(&to);
        self.snapshots.remove(&to);
        self.commit(to, slot, len, None);
        len
    }

    /// Every tensor holding a row per cell, each once, in a fixed order: layers sharing a
    /// donor's cache, and MLA's V inside K, hold one tensor twice.
    fn row_tensors(&self) -> Vec<*mut sys::ggml_tensor> {
        let mut tensors: Vec<*mut sys::ggml_tensor> = Vec::new();
        for kv in self.layers.iter().chain(self.shadows.iter().map(|(_, kv)| kv)) {
            for t in [kv.k, kv.v] {
                if !t.is_null() && !tensors.contains(&t) {
                    tensors.push(t);
                }
            }
        }
        tensors
    }

    /// Bytes one position takes over every row tensor.
    pub fn row_bytes(&self) -> usize {
        // SAFETY: tensors this cache owns; only their shapes are read.
        self.row_tensors().into_iter().map(|t| unsafe { sys::ggml_row_size((*t).type_, (*t).ne[0]) }).sum()
    }

    /// Every recurrent layer's state tensors (convolution, then delta net), in layer order:
    /// one row per slot each.
    fn state_tensors(&self) -> Vec<*mut sys::ggml_tensor> {
        self.layers.iter().filter_map(|l| l.state).flat_map(|st| [st.conv, st.ssm]).collect()
    }

    /// Bytes of one sequence's recurrent state over every recurrent layer (0 without any).
    pub fn state_bytes(&self) -> usize {
        // SAFETY: tensors this cache owns; only their shapes are read.
        self.state_tensors().into_iter().map(|t| unsafe { sys::ggml_row_size((*t).type_, (*t).ne[0]) }).sum()
    }

    /// Bytes of a block of `n` positions read by [`KvCache::read_rows`]: the rows, and
    /// `with_state` the recurrent layers' state where the block ends.
    pub fn block_bytes(&self, n: usize, with_state: bool) -> usize {
        n * self.row_bytes() + if with_state { self.state_bytes() } else { 0 }
    }

    /// The recurrent state of `slot` in every recurrent layer, one tensor's row after
    /// another (see [`KvCache::state_tensors`]).
    fn read_state(&self, slot: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.state_bytes());
        // SAFETY: reads one slot's row of tensors this cache owns; nothing computes while
        // the cache is borrowed.
        unsafe {
            for t in self.state_tensors() {
                let row = sys::ggml_row_size((*t).type_, (*t).ne[0]);
                let start = out.len();
                out.resize(start + row, 0);
                sys::ggml_backend_tensor_get(t, out[start..].as_mut_ptr().cast(), slot * row, row);
            }
        }
        out
    }

    /// Puts a state read by [`KvCache::read_state`] into `slot` (`data` is exactly
    /// [`KvCache::state_bytes`] long).
    fn write_state(&mut self, slot: usize, data: &[u8]) {
        let mut offset = 0;
        // SAFETY: writes one slot's row of tensors this cache owns, from a buffer holding
        // every row (checked by the callers); nothing computes while borrowed mutably.
        unsafe {
            for t in self.state_tensors() {
                let row = sys::ggml_row_size((*t).type_, (*t).ne[0]);
                sys::ggml_backend_tensor_set(t, data[offset..offset + row].as_ptr().cast(), slot * row, row);
                offset += row;
            }
        }
    }

    /// What a block of rows of this cache is made of (each row tensor's ggml type and
    /// width, in the order [`KvCache::read_rows`] writes them): two caches whose layouts
    /// are equal read and write each other's blocks.
    pub fn row_layout(&self) -> String {
        // SAFETY: tensors this cache owns; only their shapes are read.
        let shape = |t: *mut sys::ggml_tensor| unsafe { format!("t{}x{}", (*t).type_, (*t).ne[0]) };
        let mut parts: Vec<String> = self.row_tensors().into_iter().map(shape).collect();
        if self.recurrent {
            // A block then holds the rows alone or ends with the state there; a window
            // without recurrent layers still says so, since the model's blocks are used so.
            parts.push(format!("rows alone or with state[{}]", self.state_tensors().into_iter().map(shape).collect::<Vec<_>>().join(",")));
        }
        parts.join(",")
    }

    /// Positions `[at, at + n)` of `seq`, every row tensor's rows one after another (see
    /// [`KvCache::row_layout`]), and `with_state` the recurrent layers' state after them: a
    /// block a later [`KvCache::write_rows`] puts back, in this cache or another of the same
    /// layout. `None` where `seq` holds fewer than `at + n` positions, or, with the state,
    /// other than `at + n` (a recurrent state is a whole past, only had where it is now).
    /// Rows alone are had at any position: a model with recurrent layers keeps its state
    /// only every few blocks (a state is far bigger than a block's rows), the rows of the
    /// others alone.
    pub fn read_rows(&self, seq: SeqId, at: usize, n: usize, with_state: bool) -> Option<Vec<u8>> {
        let with_state = with_state && self.recurrent;
        let s = self.seqs.get(&seq).copied().filter(|s| at + n <= s.len && (!with_state || at + n == s.len))?;
        let mut out = Vec::with_capacity(self.block_bytes(n, with_state));
        // SAFETY: reads rows of this sequence's slot of tensors this cache owns, within the
        // slot (at + n <= len <= capacity); nothing computes while the cache is borrowed.
        unsafe {
            for t in self.row_tensors() {
                let row = sys::ggml_row_size((*t).type_, (*t).ne[0]);
                let start = out.len();
                out.resize(start + n * row, 0);
                sys::ggml_backend_tensor_get(t, out[start..].as_mut_ptr().cast(), (s.slot * self.slot_cells + at) * row, n * row);
            }
        }
        if with_state {
            out.extend_from_slice(&self.read_state(s.slot));
        }
        Some(out)
    }

    /// Puts a block read by [`KvCache::read_rows`] back as positions `[at, at + n)` of
    /// `seq`, which keeps its first `at` positions and holds `at + n` then; a block with the
    /// state (told by its length) sets the state at `at + n` too. A block of rows alone
    /// leaves the state as it was, which is not the state at `at + n`: the caller follows it
    /// with a block with the state (a restore ends on one) or clears the sequence. False,
    /// with nothing changed, where `seq` holds fewer than `at` positions, the block is not
    /// `n` rows of this layout (a cache without layers, the output window's, takes an empty
    /// one), it would pass the context, or no slot is free for a new `seq`.
    pub fn write_rows(&mut self, seq: SeqId, at: usize, n: usize, block: &[u8]) -> bool {
        let with_state = block.len() == self.block_bytes(n, true);
        if !with_state && block.len() != self.block_bytes(n, false) || self.len(seq) < at {
            return false;
        }
        if at + n > self.capacity {
            return false;
        }
        let Ok(slot) = self.slot_for(seq, &[]) else { return false };
        let mut offset = 0;
        // SAFETY: writes rows of this sequence's slot of tensors this cache owns, within the
        // slot (at + n <= capacity <= slot_cells); nothing computes while the cache is borrowed.
        unsafe {
            for t in self.row_tensors() {
                let row = sys::ggml_row_size((*t).type_, (*t).ne[0]);
                sys::ggml_backend_tensor_set(t, block[offset..].as_ptr().cast(), (slot * self.slot_cells + at) * row, n * row);
                offset += n * row;
            }
        }
        if with_state {
            self.write_state(slot, &block[offset..]);
        }
        // A checkpoint past `at` was taken over rows this block replaced.
        if let Some(cps) = self.checkpoints.get_mut(&seq) {
            cps.retain(|c| c.len <= at);
        }
        self.snapshots.remove(&seq);
        self.commit(seq, slot, at + n, None);
        true
    }

    /// Copies `seq`'s recurrent state as it is now (at its current length) so that a
    /// later `truncate` can come back to it; no effect on a window without recurrent
    /// layers or on an unknown sequence.
    pub fn checkpoint(&mut self, seq: SeqId) {
        let Some(cur) = self.seqs.get(&seq).copied().filter(|_| self.recurrent) else { return };
        let data = self.read_state(cur.slot);
        let cps = self.checkpoints.entry(seq).or_default();
        cps.retain(|c| c.len < cur.len);
        cps.push(Checkpoint { len: cur.len, data });
        if cps.len() > CHECKPOINTS_PER_SEQUENCE {
            cps.remove(0);
        }
    }

    /// Zeroes the recurrent state of `slot`: a sequence starting from position 0.
    pub fn reset_state(&mut self, slot: usize) {
        // SAFETY: the slot's rows of tensors this cache owns; nothing computes.
        unsafe {
            for st in self.layers.iter().filter_map(|l| l.state) {
                for t in [st.conv, st.ssm] {
                    let row = sys::ggml_row_size((*t).type_, (*t).ne[0]);
                    sys::ggml_backend_tensor_memset(t, 0, slot * row, row);
                }
            }
        }
    }
}
