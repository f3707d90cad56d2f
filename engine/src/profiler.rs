//! Measures this device for the scheduler: what the engine's own kernels compute per
//! second for each weight format at decode shapes, how fast memory reads, how long a KV
//! write takes, how fast the disk holding the model reads (past the page cache), and how
//! much memory there is. Each measurement runs for a fixed short time, so a whole profile
//! takes a few seconds.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use llama_cpp_sys_2 as sys;

use crate::gguf::GgmlType;
use crate::{Error, Result};

/// Columns of the benchmark matrix: a multiple of every block size (256 for K-quants).
const MATVEC_COLS: usize = 4096;
/// Bytes of the benchmark matrix: in cache, so the kernel's compute rate is measured and
/// not memory bandwidth (the scheduler models memory reads separately, `T^cpu`).
const MATVEC_BYTES: usize = 2 << 20;
/// Bytes read for the memory bandwidth: well past any cache.
const MEMORY_BYTES: usize = 256 << 20;
/// Bytes of the scratch file for the disk test, and the block of a sequential read.
const DISK_FILE_BYTES: usize = 128 << 20;
const DISK_BLOCK: usize = 4 << 20;
/// The unit of a random read: one page, as mmap faults read.
const PAGE: usize = 4096;

/// Floating-point operations per second of a matrix-vector product whose matrix is in
/// format `ty` (2 FLOPs per weight), measured for about `time` with `threads` threads.
pub fn matvec_flops(ty: GgmlType, threads: usize, time: Duration) -> Result<f64> {
    crate::backend::init();
    // SAFETY: plain size query.
    let row = unsafe { sys::ggml_row_size(ty as u32, MATVEC_COLS as i64) };
    let rows = (MATVEC_BYTES / row).max(1);
    // SAFETY: plain size queries.
    let overhead = unsafe { sys::ggml_tensor_overhead() * 8 + sys::ggml_graph_overhead() };
    // Weights and the input and output vectors (F32); the work buffer is separate.
    let mem = overhead + rows * row + 4 * (MATVEC_COLS + rows) + (1 << 20);
    // SAFETY: ggml allocates and owns `mem` bytes; freed below.
    let ctx = unsafe { sys::ggml_init(sys::ggml_init_params { mem_size: mem, mem_buffer: std::ptr::null_mut(), no_alloc: false }) };
    if ctx.is_null() {
        return Err(Error::Ggml("ggml_init failed".into()));
    }
    let result = (|| {
        let w = crate::ggml::new_tensor(ctx, ty as u32, &[MATVEC_COLS as u64, rows as u64])?;
        let x = crate::ggml::new_tensor(ctx, GgmlType::F32 as u32, &[MATVEC_COLS as u64, 1])?;
        let (weights, values) = benchmark_matrix(ty, rows);
        // SAFETY: `w` has room for `rows` rows of `MATVEC_COLS` values in format `ty`
        // (`weights` is exactly that), `x` for MATVEC_COLS F32 values.
        unsafe {
            std::ptr::copy_nonoverlapping(weights.as_ptr(), (*w).data.cast::<u8>(), weights.len());
            std::ptr::copy_nonoverlapping(values.as_ptr(), (*x).data.cast::<f32>(), MATVEC_COLS);
            let y = sys::ggml_mul_mat(ctx, w, x);
            let gf = sys::ggml_new_graph(ctx);
            sys::ggml_build_forward_expand(gf, y);
            // One plan and work buffer for every run (`ggml_graph_compute_with_ctx` would
            // take a new buffer from the context each time).
            let mut plan = sys::ggml_graph_plan(gf, threads as i32, std::ptr::null_mut());
            let mut work = vec![0u8; plan.work_size.max(1)];
            plan.work_data = work.as_mut_ptr();
            // Warm up (thread start, caches), then whole runs for about `time`.
            let secs = per_run(time, || match sys::ggml_graph_compute(gf, &mut plan) {
                sys::GGML_STATUS_SUCCESS => Ok(()),
                _ => Err(Error::Ggml(format!("matrix-vector product in {} failed", ty.name()))),
            })?;
            Ok(2.0 * (rows * MATVEC_COLS) as f64 / secs)
        }
    })();
    // SAFETY: the context and everything in it is no longer used.
    unsafe { sys::ggml_free(ctx) };
    result
}

/// A `rows` × `MATVEC_COLS` benchmark matrix in format `ty` (the format's own quantizer
/// writes it, so every block is valid) and the F32 values it was made from (the first
/// row doubles as the input vector). Deterministic values of a realistic spread. Formats
/// whose quantizer needs an importance matrix (IQ2_XXS, IQ2_XS, IQ1_S; ggml aborts
/// without one) get a uniform one.
fn benchmark_matrix(ty: GgmlType, rows: usize) -> (Vec<u8>, Vec<f32>) {
    let values: Vec<f32> = (0..rows * MATVEC_COLS).map(|i| ((i.wrapping_mul(2654435761) % 2001) as f32 - 1000.0) * 1e-3).collect();
    if ty == GgmlType::F32 {
        return (values.iter().flat_map(|v| v.to_le_bytes()).collect(), values);
    }
    // SAFETY: plain size query; the destination holds `rows` rows of this format and the
    // importance matrix one weight per column.
    unsafe {
        let mut out = vec![0u8; sys::ggml_row_size(ty as u32, MATVEC_COLS as i64) * rows];
        let uniform = vec![1.0f32; MATVEC_COLS];
        let imatrix = if sys::ggml_quantize_requires_imatrix(ty as u32) { uniform.as_ptr() } else { std::ptr::null() };
        sys::ggml_quantize_chunk(ty as u32, values.as_ptr(), out.as_mut_ptr().cast(), 0, rows as i64, MATVEC_COLS as i64, imatrix);
        (out, values)
    }
}

/// What the scheduler's GPU terms need of an accelerator, measured on it.
#[derive(Debug, Clone)]
pub struct AcceleratorRates {
    /// FLOP/s of a matrix-vector product per weight format (decode shapes).
    pub flops: Vec<(GgmlType, f64)>,
    /// Bytes/s it reads weights from its own memory (an F32 matrix far past its caches).
    pub read_bw: f64,
    /// Seconds to copy one hidden state (`hidden_bytes`) host → device, and back.
    pub host_to_device_s: f64,
    pub device_to_host_s: f64,
    /// Seconds to write one token's K and V of one layer (`kv_bytes` of F16 from F32).
    pub kv_copy_s: f64,
}

/// Matrix bytes of an accelerator's compute-rate benchmark: within a GPU's L2 (tens of
/// MiB on current parts), so the kernel's rate is measured and not the memory's.
const ACCEL_MATVEC_BYTES: usize = 8 << 20;
/// Matrix bytes of its bandwidth benchmark: past any GPU cache.
const ACCEL_READ_BYTES: usize = 256 << 20;

/// Measures `acc` for the formats `types` (a format it cannot run is left out), one hidden
/// state of `hidden_bytes` and a KV write of `kv_bytes`, each for about `time`.
pub fn accelerator_rates(acc: &crate::Accelerator, types: &[GgmlType], hidden_bytes: usize, kv_bytes: usize, time: Duration) -> Result<AcceleratorRates> {
    crate::backend::init();
    let mut flops = Vec::new();
    for &ty in types {
        match accel_matvec(acc, ty, ACCEL_MATVEC_BYTES, time) {
            Ok((f, _)) => flops.push((ty, f)),
            Err(e) => tracing::debug!("no {} rate for {}: {e}", acc.info.name, ty.name()),
        }
    }
    // The largest matrix the device takes (a buffer may be capped below ACCEL_READ_BYTES:
    // lavapipe's storage buffers are).
    let mut bytes = ACCEL_READ_BYTES.min(acc.info.memory_free as usize / 4).max(ACCEL_MATVEC_BYTES);
    let read_bw = loop {
        match accel_matvec(acc, GgmlType::F32, bytes, time) {
            Ok((_, bw)) => break bw,
            Err(_) if bytes > ACCEL_MATVEC_BYTES => bytes /= 2,
            Err(e) => return Err(e),
        }
    };
    let (host_to_device_s, device_to_host_s) = accel_copies(acc, hidden_bytes, time)?;
    let kv_copy_s = accel_kv_write(acc, kv_bytes, time)?;
    Ok(AcceleratorRates { flops, read_bw, host_to_device_s, device_to_host_s, kv_copy_s })
}

/// Runs `f` for about `time` after one warm-up run; seconds per run.
fn per_run(time: Duration, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    let start = Instant::now();
    let mut runs = 0u32;
    while start.elapsed() < time || runs == 0 {
        f()?;
        runs += 1;
    }
    Ok(start.elapsed().as_secs_f64() / f64::from(runs))
}

/// A ggml context for a few tensors and one graph, its tensors allocated on `acc`.
fn accel_context(n_tensors: usize) -> Result<crate::ggml::Allocations> {
    // SAFETY: plain size queries; ggml owns the metadata buffer, freed with the context.
    let ctx = unsafe {
        let mem = sys::ggml_tensor_overhead() * n_tensors + sys::ggml_graph_overhead();
        sys::ggml_init(sys::ggml_init_params { mem_size: mem, mem_buffer: std::ptr::null_mut(), no_alloc: true })
    };
    if ctx.is_null() {
        return Err(Error::Ggml("ggml_init failed".into()));
    }
    Ok(crate::ggml::Allocations { contexts: vec![ctx], buffers: Vec::new() })
}

/// Allocates every tensor of `a`'s context on the accelerator.
fn allocate_on(acc: &crate::Accelerator, a: &mut crate::ggml::Allocations) -> Result<()> {
    // SAFETY: the context is live; the buffer is freed with `a`.
    let buf = unsafe { sys::ggml_backend_alloc_ctx_tensors(a.contexts[0], acc.backend) };
    if buf.is_null() {
        return Err(Error::Ggml(format!("could not allocate on {}", acc.info.name)));
    }
    a.buffers.push(buf);
    Ok(())
}

/// Builds and runs `out`'s graph on the accelerator for about `time`; seconds per run.
fn accel_run(acc: &crate::Accelerator, ctx: *mut sys::ggml_context, out: *mut sys::ggml_tensor, what: &str, time: Duration) -> Result<f64> {
    // SAFETY: `out` and its sources are tensors of `ctx`, allocated on the backend.
    unsafe {
        let gf = sys::ggml_new_graph(ctx);
        sys::ggml_build_forward_expand(gf, out);
        per_run(time, || match sys::ggml_backend_graph_compute(acc.backend, gf) {
            sys::GGML_STATUS_SUCCESS => Ok(()),
            status => Err(Error::Ggml(format!("{what} on {} failed ({status})", acc.info.name))),
        })
    }
}

/// FLOP/s and weight bytes/s of a matrix-vector product in `ty` over about `bytes` of
/// matrix on the accelerator.
fn accel_matvec(acc: &crate::Accelerator, ty: GgmlType, bytes: usize, time: Duration) -> Result<(f64, f64)> {
    // SAFETY: plain size query.
    let row = unsafe { sys::ggml_row_size(ty as u32, MATVEC_COLS as i64) };
    let rows = (bytes / row).max(1);
    let mut a = accel_context(3)?;
    let ctx = a.contexts[0];
    let w = crate::ggml::new_tensor(ctx, ty as u32, &[MATVEC_COLS as u64, rows as u64])?;
    let x = crate::ggml::new_tensor(ctx, GgmlType::F32 as u32, &[MATVEC_COLS as u64, 1])?;
    // SAFETY: tensors of the live context.
    let y = unsafe { sys::ggml_mul_mat(ctx, w, x) };
    // SAFETY: the op is only asked about, not run.
    if !unsafe { sys::ggml_backend_supports_op(acc.backend, y) } {
        return Err(Error::Ggml(format!("{} cannot multiply {}", acc.info.name, ty.name())));
    }
    allocate_on(acc, &mut a)?;
    let (weights, values) = benchmark_matrix(ty, rows);
    // SAFETY: sizes match the tensors' (`weights` is `rows` rows of `ty`).
    unsafe {
        sys::ggml_backend_tensor_set(w, weights.as_ptr().cast(), 0, weights.len());
        sys::ggml_backend_tensor_set(x, values.as_ptr().cast(), 0, MATVEC_COLS * 4);
    }
    let secs = accel_run(acc, ctx, y, "matrix-vector product", time)?;
    Ok((2.0 * (rows * MATVEC_COLS) as f64 / secs, weights.len() as f64 / secs))
}

/// Seconds to copy `bytes` host → accelerator and back (what a window split between the
/// CPU and a discrete GPU pays per token in each direction).
fn accel_copies(acc: &crate::Accelerator, bytes: usize, time: Duration) -> Result<(f64, f64)> {
    let n = (bytes / 4).max(1);
    let mut a = accel_context(1)?;
    let t = crate::ggml::new_tensor(a.contexts[0], GgmlType::F32 as u32, &[n as u64])?;
    allocate_on(acc, &mut a)?;
    let mut host = vec![0.5f32; n];
    // SAFETY: `t` holds n F32 values, as does `host`.
    let up = per_run(time / 2, || {
        unsafe { sys::ggml_backend_tensor_set(t, host.as_ptr().cast(), 0, n * 4) };
        Ok(())
    })?;
    // SAFETY: as above.
    let down = per_run(time / 2, || {
        unsafe { sys::ggml_backend_tensor_get(t, host.as_mut_ptr().cast(), 0, n * 4) };
        Ok(())
    })?;
    Ok((up, down))
}

/// Seconds to write `kv_bytes` of F16 K and V from F32 on the accelerator.
fn accel_kv_write(acc: &crate::Accelerator, kv_bytes: usize, time: Duration) -> Result<f64> {
    let n = (kv_bytes / 2).max(1) as u64;
    let mut a = accel_context(3)?;
    let ctx = a.contexts[0];
    let src = crate::ggml::new_tensor(ctx, GgmlType::F32 as u32, &[n])?;
    let dst = crate::ggml::new_tensor(ctx, GgmlType::F16 as u32, &[n])?;
    // SAFETY: tensors of the live context.
    let cpy = unsafe { sys::ggml_cpy(ctx, src, dst) };
    allocate_on(acc, &mut a)?;
    accel_run(acc, ctx, cpy, "KV write", time)
}

/// Bytes per second read from memory by `threads` threads summing a buffer far larger
/// than any cache (best of a few passes).
pub fn memory_read_bw(threads: usize) -> f64 {
    let words = MEMORY_BYTES / 8;
    let data: Vec<u64> = (0..words as u64).collect();
    let threads = threads.max(1);
    let chunk = words.div_ceil(threads);
    let mut best = 0.0f64;
    for _ in 0..3 {
        let start = Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let handles: Vec<_> = data.chunks(chunk).map(|c| s.spawn(move || c.iter().fold(0u64, |a, &v| a.wrapping_add(v)))).collect();
            handles.into_iter().map(|h| h.join().unwrap_or(0)).fold(0, u64::wrapping_add)
        });
        std::hint::black_box(total);
        best = best.max(MEMORY_BYTES as f64 / start.elapsed().as_secs_f64());
    }
    best
}

/// Seconds to write one token's K and V of one layer (`kv_bytes`, F16) into a cache much
/// larger than the caches, as a decode step does.
pub fn kv_copy_secs(kv_bytes: usize) -> f64 {
    let kv_bytes = kv_bytes.max(1);
    let slots = (MEMORY_BYTES / 4 / kv_bytes).max(1);
    let mut cache = vec![0u8; slots * kv_bytes];
    let src = vec![1u8; kv_bytes];
    let start = Instant::now();
    for i in 0..slots {
        cache[i * kv_bytes..(i + 1) * kv_bytes].copy_from_slice(&src);
    }
    std::hint::black_box(&cache);
    start.elapsed().as_secs_f64() / slots as f64
}

/// Sequential and random (4 KiB) read throughput, bytes per second, of the disk holding
/// `dir`, read past the page cache: a fresh scratch file read with O_DIRECT (or, where a
/// file system refuses O_DIRECT, after dropping it from the cache). Where `dir` cannot be
/// written (a models folder mounted read-only into a container, or owned by another
/// user), the first `DISK_FILE_BYTES` of `existing` (the model file, on that same disk)
/// are read instead.
pub fn disk_read(dir: &Path, existing: Option<&Path>, time: Duration) -> Result<(f64, f64)> {
    let path = dir.join(format!(".hearth-profile-{}.tmp", std::process::id()));
    let result = match write_scratch(&path) {
        Ok(()) => read_rates(&path, DISK_FILE_BYTES, time),
        Err(e) => match existing {
            Some(file) if matches!(e.kind(), std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem) => {
                std::fs::metadata(file).and_then(|m| read_rates(file, (m.len() as usize).min(DISK_FILE_BYTES), time))
            }
            _ => Err(e),
        },
    };
    let _ = std::fs::remove_file(&path);
    result.map_err(|e| Error::Ggml(format!("disk test in {}: {e}", dir.display())))
}

fn write_scratch(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    // A new file, never written through a link planted at its name: the folder may be one
    // others can write (a shared models folder).
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).custom_flags(libc::O_NOFOLLOW).open(path)?;
    let block: Vec<u8> = (0..DISK_BLOCK).map(|i| (i.wrapping_mul(31) >> 3) as u8).collect();
    for _ in 0..DISK_FILE_BYTES / DISK_BLOCK {
        f.write_all(&block)?;
    }
    f.sync_all()
}

/// Reads the first `bytes` of `path` in order, then random pages of them for `time`.
fn read_rates(path: &Path, bytes: usize, time: Duration) -> std::io::Result<(f64, f64)> {
    if bytes < PAGE {
        return Err(std::io::Error::other(format!("{} is too small to time reads", path.display())));
    }
    {
        let mut f = open_uncached(path)?;
        let mut buf = AlignedBuf::new(DISK_BLOCK);
        let start = Instant::now();
        let mut read = 0usize;
        while read < bytes {
            match f.read(buf.as_mut())? {
                0 => break,
                n => read += n,
            }
        }
        let seq = read as f64 / start.elapsed().as_secs_f64();
        let mut f = open_uncached(path)?;
        let pages = (bytes / PAGE) as u64;
        let start = Instant::now();
        let mut n = 0u64;
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        while start.elapsed() < time || n == 0 {
            // xorshift: a different page every read, no page twice in a row.
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            f.seek(SeekFrom::Start((state % pages) * PAGE as u64))?;
            f.read_exact(&mut buf.as_mut()[..PAGE])?;
            n += 1;
        }
        let rand = (n as usize * PAGE) as f64 / start.elapsed().as_secs_f64();
        Ok((seq, rand))
    }
}

fn open_uncached(path: &Path) -> std::io::Result<std::fs::File> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        if let Ok(f) = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path) {
            return Ok(f);
        }
    }
    let f = std::fs::File::open(path)?;
    #[cfg(unix)]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: advice on an open descriptor; failure only leaves pages cached.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
    Ok(f)
}

/// A page-aligned buffer, as O_DIRECT reads require.
struct AlignedBuf {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

impl AlignedBuf {
    fn new(len: usize) -> AlignedBuf {
        let layout = std::alloc::Layout::from_size_align(len, PAGE).expect("page-aligned layout");
        // SAFETY: non-zero size; freed in Drop with the same layout.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        AlignedBuf { ptr, layout }
    }

    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: `ptr` holds `layout.size()` initialised bytes owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) };
    }
}

/// Memory figures from /proc/meminfo, bytes: (total, available, free swap).
pub fn meminfo() -> (u64, u64, u64) {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kib = |key: &str| crate::residency::field_u64(&text, key).unwrap_or(0) * 1024;
    (kib("MemTotal:"), kib("MemAvailable:"), kib("SwapFree:"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_and_memory_measure_something_plausible() {
        for ty in [GgmlType::F32, GgmlType::Q4_K, GgmlType::Q8_0] {
            let f = matvec_flops(ty, 1, Duration::from_millis(30)).unwrap();
            // Between 10 MFLOP/s and 10 TFLOP/s on anything hearth runs on.
            assert!(f > 1e7 && f < 1e13, "{} {f}", ty.name());
        }
        let bw = memory_read_bw(1);
        assert!(bw > 1e8 && bw < 1e12, "{bw}");
        let kv = kv_copy_secs(768);
        assert!(kv > 0.0 && kv < 1e-3, "{kv}");
        let (total, avail, _) = meminfo();
        assert!(total > 0 && avail > 0 && avail <= total);
    }

    #[test]
    fn the_disk_is_read_and_the_scratch_file_removed() {
        let dir = std::env::temp_dir().join(format!("hearth-disk-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (seq, rand) = disk_read(&dir, None, Duration::from_millis(50)).unwrap();
        assert!(seq > 1e6 && rand > 1e4, "{seq} {rand}");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "scratch file left behind");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_folder_that_cannot_be_written_is_measured_on_the_file_given() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("hearth-disk-ro-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let model = dir.join("model.bin");
        std::fs::write(&model, vec![7u8; 8 << 20]).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).unwrap();
        // What the fallback reads: a file shorter than the scratch file.
        let (seq, rand) = read_rates(&model, 8 << 20, Duration::from_millis(20)).unwrap();
        assert!(seq > 1e6 && rand > 1e4, "{seq} {rand}");
        // Root writes anyway; then only a non-root run reaches the fallback here (the
        // Docker test runs it as a non-root user on a read-only mount).
        let writable = std::fs::File::create(dir.join("probe")).is_ok();
        let _ = std::fs::remove_file(dir.join("probe"));
        if !writable {
            let err = disk_read(&dir, None, Duration::from_millis(20)).unwrap_err().to_string();
            assert!(err.contains("disk test"), "{err}");
            let (seq, rand) = disk_read(&dir, Some(&model), Duration::from_millis(20)).unwrap();
            assert!(seq > 1e6 && rand > 1e4, "{seq} {rand}");
        }
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
