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
