//! The few ggml plumbing pieces the engine shares: contexts that hold only tensor
//! metadata, devices, and the accelerator (when a GPU backend is compiled in).

use std::ffi::CStr;

use llama_cpp_sys_2 as sys;

use crate::{Error, Result};

/// Where a layer's weights and KV cache live and its ops run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Accelerator,
}

/// F16 bit patterns of the two values an attention mask holds.
pub const F16_ZERO: u16 = 0x0000;
pub const F16_NEG_INF: u16 = 0xFC00;

/// ggml contexts and backend buffers owned together: the buffers hold the data of the
/// contexts' tensors, so they are freed first, then the contexts, each exactly once.
#[derive(Default)]
pub struct Allocations {
    pub contexts: Vec<*mut sys::ggml_context>,
    pub buffers: Vec<sys::ggml_backend_buffer_t>,
}

impl Drop for Allocations {
    fn drop(&mut self) {
        // SAFETY: each pointer came from ggml, is owned by this value alone and is freed
        // exactly once here.
        unsafe {
            for b in self.buffers.drain(..) {
                sys::ggml_backend_buffer_free(b);
            }
            for c in self.contexts.drain(..) {
                sys::ggml_free(c);
            }
        }
    }
}

/// A ggml context that allocates no tensor data, only the metadata of `n_tensors`
/// tensors (data comes from a backend buffer or the model mapping).
pub fn new_meta_context(n_tensors: usize) -> Result<*mut sys::ggml_context> {
    // SAFETY: plain size query.
    let overhead = unsafe { sys::ggml_tensor_overhead() };
    let params = sys::ggml_init_params { mem_size: overhead * n_tensors.max(1), mem_buffer: std::ptr::null_mut(), no_alloc: true };
    // SAFETY: ggml owns the metadata buffer it allocates; freed by ggml_free.
    let ctx = unsafe { sys::ggml_init(params) };
    if ctx.is_null() {
        return Err(Error::Ggml("ggml_init failed".into()));
    }
    Ok(ctx)
}

pub fn new_tensor(ctx: *mut sys::ggml_context, ty: u32, dims: &[u64]) -> Result<*mut sys::ggml_tensor> {
    let mut ne = [1i64; 4];
    if dims.is_empty() || dims.len() > 4 {
        return Err(Error::Ggml(format!("tensor with {} dimensions", dims.len())));
    }
    for (i, d) in dims.iter().enumerate() {
        ne[i] = i64::try_from(*d).map_err(|_| Error::Ggml("dimension too large".into()))?;
    }
    // SAFETY: ctx is a live context with room for this tensor's metadata.
    let t = unsafe { sys::ggml_new_tensor(ctx, ty, dims.len() as i32, ne.as_ptr()) };
    if t.is_null() {
        return Err(Error::Ggml("out of tensor metadata space".into()));
    }
    Ok(t)
}

/// The first GPU-like device ggml knows about, with its backend and buffer type. In the
/// default CPU-only build there is none, and asking for accelerator layers is an error.
pub struct Accelerator {
    pub backend: sys::ggml_backend_t,
    pub buffer_type: sys::ggml_backend_buffer_type_t,
    pub name: String,
}

unsafe impl Send for Accelerator {}

impl Accelerator {
    pub fn first() -> Result<Accelerator> {
        crate::backend::init();
        // SAFETY: registry queries; pointers are owned by ggml's static registry.
        unsafe {
            for i in 0..sys::ggml_backend_dev_count() {
                let dev = sys::ggml_backend_dev_get(i);
                let ty = sys::ggml_backend_dev_type(dev);
                if ty == sys::GGML_BACKEND_DEVICE_TYPE_GPU || ty == sys::GGML_BACKEND_DEVICE_TYPE_IGPU {
                    let backend = sys::ggml_backend_dev_init(dev, std::ptr::null());
                    if backend.is_null() {
                        continue;
                    }
                    let name = CStr::from_ptr(sys::ggml_backend_dev_name(dev)).to_string_lossy().into_owned();
                    return Ok(Accelerator { backend, buffer_type: sys::ggml_backend_dev_buffer_type(dev), name });
                }
            }
        }
        Err(Error::Ggml(
            "no accelerator backend is available: build with --features cuda, metal or vulkan to place layers on a GPU".into(),
        ))
    }
}

impl Drop for Accelerator {
    fn drop(&mut self) {
        // SAFETY: backend was created by ggml_backend_dev_init and is freed once.
        unsafe { sys::ggml_backend_free(self.backend) };
    }
}

/// What a weight is multiplied by, for asking a buffer type whether it can hold it
/// (llama.cpp's `weight_buft_supported` with the same probe shapes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightOp {
    MulMat,
    /// Stacked expert matrices; the number of experts a token uses.
    MulMatId(usize),
}

/// The CPU backend's extra buffer types: layouts its kernels prefer for some weight
/// types (ggml-cpu's "repack" — interleaved Q4_0/Q4_K/IQ4_NL/... blocks for AVX2,
/// AVX-512 and ARM dot-product kernels — and, where built, AMX or KleidiAI). llama.cpp
/// puts every weight one of them takes there (its default `use_extra_bufts`), which also
/// changes the kernels and so the rounding; hearth does the same to compute the same.
pub struct CpuExtraBuffers {
    dev: sys::ggml_backend_dev_t,
    pub types: Vec<sys::ggml_backend_buffer_type_t>,
}

impl CpuExtraBuffers {
    /// None: every weight stays in the plain CPU layout.
    pub fn none() -> CpuExtraBuffers {
        CpuExtraBuffers { dev: std::ptr::null_mut(), types: Vec::new() }
    }

    pub fn get() -> CpuExtraBuffers {
        crate::backend::init();
        type GetExtraBufts = unsafe extern "C" fn(sys::ggml_backend_dev_t) -> *mut sys::ggml_backend_buffer_type_t;
        // SAFETY: registry queries on ggml's static registry; the proc address, when
        // present, has the signature ggml-backend.h declares for this name.
        unsafe {
            let dev = sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_CPU);
            if dev.is_null() {
                return CpuExtraBuffers { dev, types: Vec::new() };
            }
            let reg = sys::ggml_backend_dev_backend_reg(dev);
            let f = sys::ggml_backend_reg_get_proc_address(reg, c"ggml_backend_dev_get_extra_bufts".as_ptr());
            let mut types = Vec::new();
            if !f.is_null() {
                let get: GetExtraBufts = std::mem::transmute(f);
                let mut p = get(dev);
                while !p.is_null() && !(*p).is_null() {
                    types.push(*p);
                    p = p.add(1);
                }
            }
            CpuExtraBuffers { dev, types }
        }
    }

    /// The first extra buffer type whose kernels take a weight of this type and shape
    /// in `op`, as llama.cpp picks it (probe batch of 512 tokens, as its loader uses).
    pub fn pick(&self, ty: u32, dims: &[u64], op: WeightOp) -> Option<sys::ggml_backend_buffer_type_t> {
        const PROBE_TOKENS: i64 = 512;
        if self.types.is_empty() || dims.len() < 2 {
            return None;
        }
        let ctx = new_meta_context(8).ok()?;
        let _free = Allocations { contexts: vec![ctx], buffers: Vec::new() };
        let w = new_tensor(ctx, ty, dims).ok()?;
        // SAFETY: tensors of a live no-alloc context; the dummy buffer is freed and the
        // weight's buffer reset before the context is freed.
        unsafe {
            let op_tensor = match op {
                WeightOp::MulMat => {
                    let b = sys::ggml_new_tensor_4d(ctx, sys::GGML_TYPE_F32, (*w).ne[0], PROBE_TOKENS, (*w).ne[2], (*w).ne[3]);
                    sys::ggml_mul_mat(ctx, w, b)
                }
                WeightOp::MulMatId(k) => {
                    let b = sys::ggml_new_tensor_3d(ctx, sys::GGML_TYPE_F32, (*w).ne[0], k as i64, PROBE_TOKENS);
                    let ids = sys::ggml_new_tensor_2d(ctx, sys::GGML_TYPE_I32, k as i64, PROBE_TOKENS);
                    sys::ggml_mul_mat_id(ctx, w, b, ids)
                }
            };
            self.types.iter().copied().find(|&buft| {
                (*w).buffer = sys::ggml_backend_buft_alloc_buffer(buft, 0);
                let ok = !(*w).buffer.is_null() && sys::ggml_backend_dev_supports_op(self.dev, op_tensor);
                if !(*w).buffer.is_null() {
                    sys::ggml_backend_buffer_free((*w).buffer);
                }
                (*w).buffer = std::ptr::null_mut();
                ok
            })
        }
    }
}
