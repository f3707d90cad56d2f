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
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::model_file::ModelFile;

/// The page size hearth assumes for alignment and touching; Linux on x86-64 and ARM64
/// uses 4 KiB base pages (huge pages only make prefetching coarser, never wrong).
const PAGE: usize = 4096;

impl ModelFile {
    /// Byte ranges of the mapping holding the tensors of `layers` (page-aligned, merged).
    pub fn layer_byte_ranges(&self, layers: Range<usize>) -> Vec<Range<usize>> {
        let data = self.gguf.data_offset() as usize;
        let mut ranges: Vec<Range<usize>> = self
            .gguf
            .meta()
            .tensors()
            .iter()
            .filter(|t| layer_of(&t.name).is_some_and(|l| layers.contains(&l)))
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
        let base = self.gguf.bytes().as_ptr();
        let mut total = 0;
        for r in ranges {
            let pages = r.len().div_ceil(PAGE);
            let mut vec = vec![0u8; pages];
            // SAFETY: the range lies inside the mapping and starts on a page boundary of
            // it (the mapping itself is page-aligned); `vec` has one byte per page.
            let rc = unsafe { libc::mincore(base.add(r.start) as *mut libc::c_void, r.len(), vec.as_mut_ptr()) };
            if rc == 0 {
                total += vec.iter().filter(|&&v| v & 1 == 1).count() * PAGE;
            }
        }
        total
    }

    /// Drops `ranges` from this process and from the page cache, so memory goes to the
    /// windows that run next. The file is unchanged; a later touch reads it back.
    pub fn release(&self, ranges: &[Range<usize>]) {
        let base = self.gguf.bytes().as_ptr();
        let file = std::fs::File::open(self.gguf.path()).ok();
        for r in ranges {
            // SAFETY: a read-only shared file mapping: dropping its pages loses nothing.
            unsafe {
                libc::madvise(base.add(r.start) as *mut libc::c_void, r.len(), libc::MADV_DONTNEED);
            }
            if let Some(f) = &file {
                use std::os::fd::AsRawFd;
                // SAFETY: plain advice on an open descriptor of the model file.
                unsafe { libc::posix_fadvise(f.as_raw_fd(), r.start as libc::off_t, r.len() as libc::off_t, libc::POSIX_FADV_DONTNEED) };
            }
        }
    }
}

/// A running prefetch: a thread that advises WILLNEED and then touches one byte per page
/// of the ranges. Join it (or drop it) to wait for the pages to be in.
pub struct Prefetch {
    thread: Option<JoinHandle<()>>,
}

impl Prefetch {
    pub fn start(file: Arc<ModelFile>, ranges: Vec<Range<usize>>) -> Prefetch {
        let thread = std::thread::Builder::new()
            .name("hearth-prefetch".into())
            .spawn(move || {
                let bytes = file.gguf.bytes();
                for r in &ranges {
                    // SAFETY: advice on a range inside the read-only mapping.
                    unsafe { libc::madvise(bytes.as_ptr().add(r.start) as *mut libc::c_void, r.len(), libc::MADV_WILLNEED) };
                }
                let mut sink = 0u8;
                for r in &ranges {
                    for off in (r.start..r.end).step_by(PAGE) {
                        // A volatile read so the touch is not optimised away.
                        // SAFETY: `off` is inside the mapping.
                        sink ^= unsafe { std::ptr::read_volatile(bytes.as_ptr().add(off)) };
                    }
                }
                std::hint::black_box(sink);
            })
            .ok();
        Prefetch { thread }
    }

    /// Waits until every page has been touched.
    pub fn wait(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}
