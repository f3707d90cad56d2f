//! Which parts of the model are in memory, and moving them in or out ahead of need.
//! Weights are file-backed mmap pages: the OS may drop them under pressure and reads them
//! back on the next touch. A device that runs several windows per token, with less
//! memory than its windows need, prefetches its next window while other devices compute
//! and releases windows it will not need soon, so disk reads overlap other work instead of
//! stalling its own (prima.cpp's piped-ring idea).
//!
//! Advice alone is not enough on Linux: MADV_WILLNEED returned at once but the pages came
//! in only when touched (DESIGN.md), so prefetching really reads the pages, on a thread.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::model_file::ModelFile;

/// The page size hearth assumes for alignment and touching; Linux on x86-64 and ARM64
/// uses 4 KiB base pages (huge pages only make prefetching coarser, never wrong).
const PAGE: usize = 4096;

impl ModelFile {
    /// Byte ranges of the mapping holding the tensors of `layers` (page-aligned, merged).
    pub fn layer_byte_ranges(&self, layers: Range<usize>) -> Vec<Range<usize>> {
        self.byte_ranges(layers, true)
    }

    /// As `layer_byte_ranges`, without a MoE layer's routed experts: what is worth reading
    /// ahead of a MoE window, whose tokens each read only a few experts.
    pub fn layer_byte_ranges_without_experts(&self, layers: Range<usize>) -> Vec<Range<usize>> {
        self.byte_ranges(layers, false)
    }

    fn byte_ranges(&self, layers: Range<usize>, experts: bool) -> Vec<Range<usize>> {
        let data = self.gguf.data_offset() as usize;
        let mut ranges: Vec<Range<usize>> = self
            .gguf
            .meta()
            .tensors()
            .iter()
            .filter(|t| layer_of(&t.name).is_some_and(|l| layers.contains(&l)))
            .filter(|t| experts || !t.name.contains("_exps."))
            .map(|t| {
                let start = data + t.offset as usize;
                (start / PAGE * PAGE)..(start + t.n_bytes as usize).div_ceil(PAGE) * PAGE
            })
            .collect();
        ranges.sort_by_key(|r| r.start);
        let mut merged: Vec<Range<usize>> = Vec::new();
        for r in ranges {
            match merged.last_mut() {
                Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
                _ => merged.push(r),
            }
        }
        let len = self.gguf.bytes().len();
        merged.into_iter().map(|r| r.start.min(len)..r.end.min(len)).filter(|r| !r.is_empty()).collect()
    }

    /// Bytes of `ranges` resident in memory now (mincore).
    pub fn resident_bytes(&self, ranges: &[Range<usize>]) -> usize {
        self.resident_bytes_with(ranges, &mut Vec::new())
    }

    /// [`resident_bytes`](Self::resident_bytes) reusing `buf` (one byte per page), so a
    /// caller that asks every step does not allocate once the buffer has grown.
    pub fn resident_bytes_with(&self, ranges: &[Range<usize>], buf: &mut Vec<u8>) -> usize {
        let base = self.gguf.bytes().as_ptr();
        let mut total = 0;
        for r in ranges {
            let pages = r.len().div_ceil(PAGE);
            buf.clear();
            buf.resize(pages, 0);
            // SAFETY: the range lies inside the mapping and starts on a page boundary of
            // it (the mapping itself is page-aligned); `buf` has one byte per page.
            let rc = unsafe { libc::mincore(base.add(r.start) as *mut libc::c_void, r.len(), buf.as_mut_ptr()) };
            if rc == 0 {
                total += buf.iter().filter(|&&v| v & 1 == 1).count() * PAGE;
            }
        }
        total
    }

    /// Maps `ranges` into this process's page tables now, reading from disk what is not in
    /// the page cache (`MADV_POPULATE_READ`, Linux 5.14+; elsewhere nothing happens and
    /// pages map as they are first touched). What llama.cpp's default `MAP_POPULATE` does
    /// for the whole file, for a stage's windows held in memory: otherwise a MoE model's
    /// decode pays a page fault the first time each expert's pages are read, through its
    /// first thousands of tokens. (Most of the gap a 15 GB qwen3moe had to llama.cpp was
    /// the mapping's alignment, `gguf::file::HUGE_PAGE`; this added a few percent in the
    /// first rounds: docs/benchmarks.md.) Never for windows paged from disk, which must
    /// not all be in memory.
    pub fn populate(&self, ranges: &[Range<usize>]) {
        let base = self.gguf.bytes().as_ptr();
        for r in ranges {
            // SAFETY: advice on a page-aligned range inside the read-only mapping.
            unsafe { libc::madvise(base.add(r.start) as *mut libc::c_void, r.len(), libc::MADV_POPULATE_READ) };
        }
    }

    /// Drops `ranges` from this process and from the page cache, so memory goes to the
    /// windows that run next. The file is unchanged; a later touch reads it back.
    pub fn release(&self, ranges: &[Range<usize>]) {
        let base = self.gguf.bytes().as_ptr();
        for r in ranges {
            // SAFETY: a read-only shared file mapping: dropping its pages loses nothing.
            unsafe {
                libc::madvise(base.add(r.start) as *mut libc::c_void, r.len(), libc::MADV_DONTNEED);
            }
            // The page cache by file: a range of a split model may cover two parts.
            for (part, within) in self.gguf.file_ranges(r.clone()) {
                use std::os::fd::AsRawFd;
                // SAFETY: plain advice on an open descriptor of a model file.
                unsafe { libc::posix_fadvise(part.file().as_raw_fd(), within.start as libc::off_t, (within.end - within.start) as libc::off_t, libc::POSIX_FADV_DONTNEED) };
            }
        }
    }
}

/// A running prefetch: a thread that advises WILLNEED and then touches one byte per page
/// of the ranges. `wait` joins it; `cancel` stops it at the next 1 MiB and joins it
/// (dropping it cancels too, so a replaced prefetch never keeps reading behind a newer one).
pub struct Prefetch {
    thread: Option<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
}

/// Pages touched between checks of the stop flag (1 MiB).
const PAGES_PER_CHECK: usize = 256;

impl Prefetch {
    pub fn start(file: Arc<ModelFile>, ranges: Vec<Range<usize>>) -> Prefetch {
        Self::start_after_release(file, Vec::new(), ranges)
    }

    /// Releases `release` (see [`ModelFile::release`]) and then reads `ranges` ahead, on
    /// the background thread, so neither delays the caller: a ring device hands its
    /// output on at once and pages out the window it just ran while others compute.
    pub fn start_after_release(file: Arc<ModelFile>, release: Vec<Range<usize>>, ranges: Vec<Range<usize>>) -> Prefetch {
        let stop = Arc::new(AtomicBool::new(false));
        let stop_flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("hearth-prefetch".into())
            .spawn(move || {
                if !release.is_empty() {
                    file.release(&release);
                }
                let bytes = file.gguf.bytes();
                for r in &ranges {
                    // SAFETY: advice on a range inside the read-only mapping.
                    unsafe { libc::madvise(bytes.as_ptr().add(r.start) as *mut libc::c_void, r.len(), libc::MADV_WILLNEED) };
                }
                let mut sink = 0u8;
                for r in &ranges {
                    for (i, off) in (r.start..r.end).step_by(PAGE).enumerate() {
                        if i % PAGES_PER_CHECK == 0 && stop_flag.load(Ordering::Relaxed) {
                            return;
                        }
                        // A volatile read so the touch is not optimised away.
                        // SAFETY: `off` is inside the mapping.
                        sink ^= unsafe { std::ptr::read_volatile(bytes.as_ptr().add(off)) };
                    }
                }
                std::hint::black_box(sink);
            })
            .ok();
        Prefetch { thread, stop }
    }

    /// Waits until every page has been touched.
    pub fn wait(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }

    /// Whether the thread is done (or never started).
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Stops reading ahead and waits for the thread (at most one page fault plus 1 MiB).
    pub fn cancel(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// This process's storage reads, from /proc/self/io, opened once: a device reads it twice
/// per window per step, and each read is then one `pread` into a stack buffer.
pub struct ProcessIo(std::fs::File);

impl ProcessIo {
    /// None where /proc is missing.
    pub fn open() -> Option<ProcessIo> {
        std::fs::File::open("/proc/self/io").ok().map(ProcessIo)
    }

    /// Bytes this process (all its threads) has caused to be read from storage so far:
    /// `read_bytes`, which counts block I/O (page-cache hits are free).
    pub fn read_bytes(&self) -> Option<u64> {
        use std::os::unix::fs::FileExt;
        let mut buf = [0u8; 512];
        let mut n = 0;
        // Reading from offset 0 makes the kernel produce the file afresh.
        while n < buf.len() {
            match self.0.read_at(&mut buf[n..], n as u64) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(_) => return None,
            }
        }
        field_u64(std::str::from_utf8(&buf[..n]).ok()?, "read_bytes:")
    }
}

/// The value of the `key` line (`key  123`, optionally followed by a unit) of a /proc file.
pub(crate) fn field_u64(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| l.strip_prefix(key)).and_then(|v| v.split_whitespace().next()).and_then(|v| v.parse().ok())
}

/// Where the memory a process may use comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemorySource {
    /// `memory.limit_in_bytes` of the process's cgroup (v1).
    CgroupV1,
    /// `memory.max` of the process's cgroup (v2).
    CgroupV2,
    /// `MemAvailable` of /proc/meminfo: no cgroup limit applies.
    MemAvailable,
}

/// How many bytes this process may fill, and where the figure comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryBudget {
    pub bytes: u64,
    pub source: MemorySource,
}

/// Limits at or above this are "no limit" (cgroup v1 writes 2^63 rounded to a page).
const UNLIMITED: u64 = 1 << 60;

/// The memory this process may use: its cgroup's limit (v1 or v2) where one is set,
/// else MemAvailable. File-backed pages (the model's mmap) count towards a cgroup's limit.
pub fn memory_budget() -> Option<MemoryBudget> {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    let cgroup = read("/proc/self/cgroup").unwrap_or_default();
    memory_budget_from(&cgroup, |p| read(p))
}

/// [`memory_budget`] over a file reader, for tests.
pub fn memory_budget_from(proc_self_cgroup: &str, read: impl Fn(&str) -> Option<String>) -> Option<MemoryBudget> {
    for line in proc_self_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next(), parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        let path = path.trim_end_matches('/');
        // In a container the process's own cgroup is mounted at the root of the
        // hierarchy, while /proc/self/cgroup may still name its path on the host
        // (`/docker/<id>`, cgroup v1 without a cgroup namespace): the path first, the root
        // when the path is not there. On a host, the root cgroup has no limit.
        let at = |dir: &str, file: &str| read(&format!("{dir}{path}/{file}")).or_else(|| read(&format!("{dir}/{file}"))).and_then(|t| parse_limit(&t));
        let limit = if controllers.split(',').any(|c| c == "memory") {
            at("/sys/fs/cgroup/memory", "memory.limit_in_bytes").map(|b| (b, MemorySource::CgroupV1))
        } else if controllers.is_empty() {
            at("/sys/fs/cgroup", "memory.max").map(|b| (b, MemorySource::CgroupV2))
        } else {
            None
        };
        if let Some((bytes, source)) = limit {
            return Some(MemoryBudget { bytes, source });
        }
    }
    let meminfo = read("/proc/meminfo")?;
    Some(MemoryBudget { bytes: field_u64(&meminfo, "MemAvailable:")? * 1024, source: MemorySource::MemAvailable })
}

/// A cgroup limit file's value; None for "max" (v2) or a v1 "unlimited" figure.
fn parse_limit(text: &str) -> Option<u64> {
    let v: u64 = text.trim().parse().ok()?;
    (v < UNLIMITED).then_some(v)
}

/// Anonymous memory this process holds now (KV caches, compute buffers): RssAnon of
/// /proc/self/status. It shares the budget with the model's pages.
pub fn anon_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    Some(field_u64(&status, "RssAnon:")? * 1024)
}

/// Whether windows needing `need` bytes overflow a `budget` of which `reserved` is taken
/// by other memory: then a device releases each window after running it, so the next
/// window's prefetch does not evict pages it will need (prima.cpp's prefetch-release conflict).
pub fn overloaded(need: u64, budget: u64, reserved: u64) -> bool {
    need.saturating_add(reserved) > budget
}

fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(entries: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |p| entries.iter().find(|(k, _)| *k == p).map(|(_, v)| v.to_string())
    }

    const MEMINFO: &str = "MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n";

    #[test]
    fn cgroup_v1_limit_is_read_from_the_process_cgroup() {
        let cg = "5:devices:/\n4:memory:/hearth/w1\n0::/\n";
        let read = files(&[("/sys/fs/cgroup/memory/hearth/w1/memory.limit_in_bytes", "536870912\n"), ("/proc/meminfo", MEMINFO)]);
        assert_eq!(memory_budget_from(cg, read), Some(MemoryBudget { bytes: 512 << 20, source: MemorySource::CgroupV1 }));
    }

    #[test]
    fn in_a_container_the_limit_is_at_the_root_of_the_mount() {
        // Docker on cgroup v1: /proc/self/cgroup names the host's path, the container
        // sees its own cgroup at the root.
        let cg = "4:memory:/docker/0123abcd\n0::/\n";
        let read = files(&[("/sys/fs/cgroup/memory/memory.limit_in_bytes", "1073741824\n"), ("/proc/meminfo", MEMINFO)]);
        assert_eq!(memory_budget_from(cg, read), Some(MemoryBudget { bytes: 1 << 30, source: MemorySource::CgroupV1 }));
    }

    #[test]
    fn unlimited_cgroups_fall_back_to_mem_available() {
        let cg = "4:memory:/\n0::/\n";
        let read = files(&[("/sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n"), ("/sys/fs/cgroup/memory.max", "max\n"), ("/proc/meminfo", MEMINFO)]);
        assert_eq!(memory_budget_from(cg, read), Some(MemoryBudget { bytes: 20_000_000 * 1024, source: MemorySource::MemAvailable }));
    }

    #[test]
    fn cgroup_v2_memory_max_is_read() {
        let cg = "0::/user.slice/hearth.scope\n";
        let read = files(&[("/sys/fs/cgroup/user.slice/hearth.scope/memory.max", "1073741824\n"), ("/proc/meminfo", MEMINFO)]);
        assert_eq!(memory_budget_from(cg, read), Some(MemoryBudget { bytes: 1 << 30, source: MemorySource::CgroupV2 }));
    }

    #[test]
    fn missing_files_give_none_and_junk_is_ignored() {
        assert_eq!(memory_budget_from("", files(&[])), None);
        let read = files(&[("/sys/fs/cgroup/memory/x/memory.limit_in_bytes", "lots"), ("/proc/meminfo", MEMINFO)]);
        assert_eq!(memory_budget_from("4:memory:/x", read).map(|b| b.source), Some(MemorySource::MemAvailable));
    }

    #[test]
    fn overload_counts_the_reserved_memory() {
        assert!(!overloaded(400, 1000, 500));
        assert!(overloaded(400, 1000, 700));
        assert!(overloaded(2000, 1000, 0));
        assert!(!overloaded(1000, 1000, 0));
        assert!(!overloaded(u64::MAX, u64::MAX, 0));
    }

    #[test]
    fn this_process_has_a_budget_and_read_counter() {
        assert!(memory_budget().is_some_and(|b| b.bytes > 0));
        let io = ProcessIo::open().unwrap();
        let first = io.read_bytes().unwrap();
        assert!(io.read_bytes().unwrap() >= first, "the counter only grows");
        assert!(anon_bytes().is_some_and(|b| b > 0));
    }
}

