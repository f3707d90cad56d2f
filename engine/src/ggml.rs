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

/// An accelerator in ggml's device registry (a GPU, an integrated GPU, or a Vulkan
/// device such as Mesa's lavapipe), as `hearth profile` reports it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct AcceleratorInfo {
    /// Position among the accelerators (`Accelerator::open`).
    pub index: usize,
    /// ggml's device name (`Vulkan0`, `CUDA0`, `MTL0`).
    pub name: String,
    /// What the driver calls it (`NVIDIA H100 80GB HBM3`, `llvmpipe (LLVM 15.0.6, 256 bits)`).
    pub description: String,
    /// The ggml backend (`Vulkan`, `CUDA`, `Metal`).
    pub backend: String,
    /// Shares memory with the host (ggml's IGPU type): no copies between them, and its
    /// memory is the host's.
    pub integrated: bool,
    pub memory_total: u64,
    pub memory_free: u64,
}

/// The accelerators of this build on this machine, in ggml's registry order. Empty in the
/// default CPU-only build. Vulkan lists only GPUs unless `GGML_VK_VISIBLE_DEVICES` names
/// others (a CPU-type device like lavapipe must be named to be used).
pub fn accelerators() -> Vec<AcceleratorInfo> {
    crate::backend::init();
    let mut out = Vec::new();
    // SAFETY: registry queries; pointers are owned by ggml's static registry and the
    // strings copied before the next call.
    unsafe {
        for i in 0..sys::ggml_backend_dev_count() {
            let dev = sys::ggml_backend_dev_get(i);
            let ty = sys::ggml_backend_dev_type(dev);
            if ty != sys::GGML_BACKEND_DEVICE_TYPE_GPU && ty != sys::GGML_BACKEND_DEVICE_TYPE_IGPU {
                continue;
            }
            let (mut free, mut total) = (0usize, 0usize);
            sys::ggml_backend_dev_memory(dev, &mut free, &mut total);
            let text = |p: *const std::ffi::c_char| if p.is_null() { String::new() } else { CStr::from_ptr(p).to_string_lossy().into_owned() };
            out.push(AcceleratorInfo {
                index: out.len(),
                name: text(sys::ggml_backend_dev_name(dev)),
                description: text(sys::ggml_backend_dev_description(dev)),
                backend: text(sys::ggml_backend_reg_name(sys::ggml_backend_dev_backend_reg(dev))),
                integrated: ty == sys::GGML_BACKEND_DEVICE_TYPE_IGPU,
                memory_total: total as u64,
                memory_free: free as u64,
            });
        }
    }
    out
}

/// An accelerator's backend and buffer type, opened for computing. In the default
/// CPU-only build there is none, and asking for accelerator layers is an error.
pub struct Accelerator {
    pub backend: sys::ggml_backend_t,
    pub buffer_type: sys::ggml_backend_buffer_type_t,
    /// The device's host buffer type (pinned memory the device copies from fast), or
    /// null where the backend has none.
    pub host_buffer_type: sys::ggml_backend_buffer_type_t,
    pub info: AcceleratorInfo,
}

unsafe impl Send for Accelerator {}

impl Accelerator {
    /// The first accelerator (what `--gpu-layers` places layers on).
    pub fn first() -> Result<Accelerator> {
        Accelerator::open(0)
    }

    /// The accelerator at `index` of [`accelerators`].
    pub fn open(index: usize) -> Result<Accelerator> {
        let Some(info) = accelerators().into_iter().nth(index) else {
            return Err(Error::Ggml(if index == 0 {
                "no accelerator backend is available: build with --features cuda, metal or vulkan to place layers on a GPU (Vulkan lists CPU-type devices such as lavapipe only when GGML_VK_VISIBLE_DEVICES names them)".into()
            } else {
                format!("there is no accelerator {index}")
            }));
        };
        let name = std::ffi::CString::new(info.name.clone()).map_err(|_| Error::Ggml("device name with a NUL".into()))?;
        // SAFETY: registry queries; the backend is freed in Drop.
        unsafe {
            let dev = sys::ggml_backend_dev_by_name(name.as_ptr());
            if dev.is_null() {
                return Err(Error::Ggml(format!("accelerator {} vanished from the registry", info.name)));
            }
            let backend = sys::ggml_backend_dev_init(dev, std::ptr::null());
            if backend.is_null() {
                return Err(Error::Ggml(format!("could not start accelerator {} ({})", info.name, info.description)));
            }
            Ok(Accelerator { backend, buffer_type: sys::ggml_backend_dev_buffer_type(dev), host_buffer_type: sys::ggml_backend_dev_host_buffer_type(dev), info })
        }
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
