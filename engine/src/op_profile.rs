//! Where a forward spends its time, op by op: ggml's scheduler computes each graph node
//! alone and reports back through its eval callback, which this module times. The same
//! callback serves hearth's stages and llama.cpp's contexts (`cb_eval`), so both engines'
//! steps are cut up the same way (`hearth bench --sequences N --ops`). Computing nodes one
//! at a time adds a thread wake-up per node to both sides: the absolute times are
//! inflated, the comparison between the two is what it is for.
//!
//! Depends on ggml's tensor layout only; nothing here knows hearth's graphs.

use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::time::Instant;

use llama_cpp_sys_2 as sys;

/// Count and total seconds of the nodes that share a key.
#[derive(Debug, Default, Clone, Copy)]
pub struct OpTime {
    pub count: u64,
    pub secs: f64,
}

/// Times per node kind while recording; idle (and costless: every node is computed with
/// its neighbours as usual) while not.
#[derive(Debug, Default)]
pub struct OpProfile {
    recording: bool,
    started: Option<Instant>,
    by_shape: HashMap<String, OpTime>,
    by_op: HashMap<String, OpTime>,
}

impl OpProfile {
    pub fn record(&mut self, on: bool) {
        self.recording = on;
        self.started = None;
    }

    /// Per op and weight type (`MUL_MAT q4_1`), slowest first.
    pub fn by_op(&self) -> Vec<(String, OpTime)> {
        sorted(&self.by_op)
    }

    /// Per op, operand types and shapes, slowest first: the finer cut for telling two
    /// graphs apart.
    pub fn by_shape(&self) -> Vec<(String, OpTime)> {
        sorted(&self.by_shape)
    }

    pub fn total_secs(&self) -> f64 {
        self.by_op.values().map(|t| t.secs).sum()
    }

    fn add(&mut self, t: *const sys::ggml_tensor, secs: f64) {
        // SAFETY: `t` is a live node of the graph being computed.
        let (op, shape) = unsafe { describe(t) };
        for (map, key) in [(&mut self.by_op, op), (&mut self.by_shape, shape)] {
            let e = map.entry(key).or_default();
            e.count += 1;
            e.secs += secs;
        }
    }
}

fn sorted(map: &HashMap<String, OpTime>) -> Vec<(String, OpTime)> {
    let mut v: Vec<(String, OpTime)> = map.iter().map(|(k, t)| (k.clone(), *t)).collect();
    v.sort_by(|a, b| b.1.secs.total_cmp(&a.1.secs).then_with(|| a.0.cmp(&b.0)));
    v
}

/// `MUL_MAT q4_1` and `MUL_MAT q4_1 576x1536 · f32 576x8 → 1536x8`.
///
/// SAFETY: `t` points to a valid tensor whose sources are valid or null.
unsafe fn describe(t: *const sys::ggml_tensor) -> (String, String) {
    let name = |p: *const std::os::raw::c_char| if p.is_null() { "?".to_string() } else { CStr::from_ptr(p).to_string_lossy().into_owned() };
    let dims = |t: *const sys::ggml_tensor| {
        let ne = (*t).ne;
        let n = ne.iter().rposition(|&d| d != 1).map_or(1, |i| i + 1);
        let strided = if sys::ggml_is_contiguous(t) { "" } else { " (strided)" };
        format!("{}{strided}", ne[..n].iter().map(i64::to_string).collect::<Vec<_>>().join("x"))
    };
    let op = name(sys::ggml_op_desc(t));
    let src0 = (*t).src[0];
    let head = if src0.is_null() { op.clone() } else { format!("{op} {}", name(sys::ggml_type_name((*src0).type_))) };
    let mut shape = head.clone();
    for (i, &s) in (*t).src.iter().take(3).enumerate() {
        if !s.is_null() {
            let sep = if i == 0 { " " } else { " · " };
            let ty = if i == 0 { String::new() } else { format!("{} ", name(sys::ggml_type_name((*s).type_))) };
            shape.push_str(&format!("{sep}{ty}{}", dims(s)));
            // Where a leaf (a weight, mostly) lives says which backend computes with it (CPU,
            // a repacked layout, a GPU); computed operands' buffers say nothing more.
            if !(*s).buffer.is_null() && (*s).op == sys::GGML_OP_NONE {
                shape.push_str(&format!(" @{}", name(sys::ggml_backend_buffer_name((*s).buffer))));
            }
        }
    }
    shape.push_str(&format!(" → {}", dims(t)));
    // The result's buffer says which backend computed the node.
    if !(*t).buffer.is_null() {
        shape.push_str(&format!(" @{}", name(sys::ggml_backend_buffer_name((*t).buffer))));
    }
    (head, shape)
}

/// The eval callback: asked about a node, wants it alone (and starts its clock); told it
/// is computed, books the time. `user_data` is the `OpProfile`.
///
/// SAFETY: `user_data` points to an `OpProfile` that outlives the scheduler's use of it and
/// is not otherwise accessed while a graph computes.
pub(crate) unsafe extern "C" fn on_node(t: *mut sys::ggml_tensor, ask: bool, user_data: *mut c_void) -> bool {
    let p = &mut *(user_data as *mut OpProfile);
    if !p.recording {
        // Not wanted (asked: computed with its neighbours), or go on (told).
        return !ask;
    }
    if ask {
        p.started = Some(Instant::now());
        return true;
    }
    if let Some(s) = p.started.take() {
        p.add(t, s.elapsed().as_secs_f64());
    }
    true
}
