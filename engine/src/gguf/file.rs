//! A model's GGUF file, or every part of a split set, mapped read-only.
//!
//! The parts are mapped one after another into one reserved address range, each at a page
//! boundary, so the rest of hearth sees one model in one byte space: a tensor is a slice of
//! [`GgufFile::bytes`] whichever part holds it, the weights bind as one zero-copy buffer,
//! and paging and read-ahead work on ranges of it as on one file. What concerns the files
//! themselves (a change under the mapping, the page cache, the parts a worker copies) goes
//! through [`GgufFile::parts`], which places each part in that byte space.

use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use super::faults::Watch;
use super::reader::{parse, GgufMeta, TensorInfo};
use super::split::{self, SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS_COUNT};
use super::value::Value;
use crate::{Error, Result};

/// Where each part starts in the model's byte space: a multiple of every page size a
/// device may have (4 KiB on x86-64, 16 or 64 KiB on some ARM machines), so a head and a
/// worker of another kind place the parts, and so every tensor, at the same offsets; and
/// of a huge page (`HUGE_PAGE`), so each part can be mapped by huge pages.
const PART_ALIGNMENT: u64 = HUGE_PAGE as u64;

/// A PMD-sized huge page (x86-64, and ARM64 with 4 KiB pages). The page cache keeps a
/// large model file in folios of this size (ext4, xfs), and the kernel maps such a folio
/// with one page-table entry only where the virtual address and the file offset agree
/// modulo its size: llama.cpp's plain `mmap` of the file gets that (13.6 of 14.2 GB
/// mapped by huge pages, measured), hearth's reservation at an address aligned to 4 KiB
/// got none, and every weight read then missed the TLB about 512 times as often — a 15 GB
/// MoE decoded at 0.84x llama.cpp.
const HUGE_PAGE: usize = 2 << 20;

/// One file of the model and where it lies in the model's byte space.
#[derive(Debug)]
pub struct Part {
    path: PathBuf,
    /// Dropped before the region is unmapped (fields drop in order, parts before the
    /// region): the fault handler must not look at a range that is no longer mapped.
    watch: Watch,
    /// The file as mapped, to tell when it changes under the mapping.
    file: File,
    opened: (u64, Option<SystemTime>),
    base: u64,
    len: u64,
    header_len: u64,
}

impl Part {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where the file's first byte is in [`GgufFile::bytes`] (a multiple of 64 KiB).
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The file's length.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The file's header: everything before its tensor data (its own data offset).
    pub fn header_len(&self) -> u64 {
        self.header_len
    }

    /// The open file, for advice to the page cache about it.
    pub fn file(&self) -> &File {
        &self.file
    }

    fn changed(&self) -> Option<String> {
        let shown = self.path.display();
        if self.watch.faulted() {
            return Some(format!("the model file {shown} was truncated while being served (a read past its new end)"));
        }
        let stat = match self.file.metadata() {
            Ok(stat) => stat,
            Err(e) => return Some(format!("the model file {shown} cannot be checked: {e}")),
        };
        let (len, modified) = self.opened;
        if stat.len() != len {
            return Some(format!("the model file {shown} changed size while being served ({len} bytes when loaded, {} now)", stat.len()));
        }
        if modified.is_some() && stat.modified().ok() != modified {
            return Some(format!("the model file {shown} was written to while being served"));
        }
        None
    }
}

/// The reserved address range the parts are mapped into; unmapped when dropped.
#[derive(Debug)]
struct Region {
    ptr: *mut u8,
    /// Reserved bytes (whole pages).
    reserved: usize,
    /// Bytes of the model: from the first part's start to the last part's end.
    len: usize,
}

// SAFETY: the region is a read-only mapping owned by this value; sharing or moving the
// pointer between threads reads the same immutable pages.
unsafe impl Send for Region {}
// SAFETY: as above, nothing writes through it.
unsafe impl Sync for Region {}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: the range was reserved by `map_parts` and is unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.reserved) };
    }
}

/// A GGUF model mapped read-only, with every part's header parsed and validated.
#[derive(Debug)]
pub struct GgufFile {
    parts: Vec<Part>,
    region: Region,
    meta: GgufMeta,
}

/// A part opened and its header parsed, before the final mapping.
struct Opened {
    path: PathBuf,
    file: File,
    opened: (u64, Option<SystemTime>),
    meta: GgufMeta,
}

fn open_one(path: &Path) -> Result<Opened> {
    let io = |source| Error::Io { path: path.to_path_buf(), source };
    let file = File::open(path).map_err(io)?;
    let stat = file.metadata().map_err(io)?;
    // A mapping only to read the header; the parts are mapped again side by side.
    // SAFETY: read-only, and watched: a file truncated while its header is parsed reads
    // zeros instead of ending the process, and is refused below.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
    let watch = Watch::register(map.as_ptr(), map.len());
    let meta = parse(&map);
    if watch.faulted() {
        return Err(Error::InvalidModel(format!("{} was truncated while its header was read", path.display())));
    }
    drop(watch);
    let meta = meta?;
    Ok(Opened { path: path.to_path_buf(), file, opened: (stat.len(), stat.modified().ok()), meta })
}

/// `(split.no, split.count)` of a part of a split set; `None` for a model in one file.
fn split_of(meta: &GgufMeta) -> Option<(u64, u64)> {
    let count = meta.get_u64(SPLIT_COUNT).filter(|&n| n > 1)?;
    Some((meta.get_u64(SPLIT_NO).unwrap_or(0), count))
}

impl GgufFile {
    /// Opens a GGUF file, or the whole split set a part of one belongs to (any part may be
    /// named; its siblings are found by name, as llama.cpp finds them).
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let first = open_one(path)?;
        let Some((no, count)) = split_of(&first.meta) else {
            return Self::map_parts(vec![first]);
        };
        let shown = path.display();
        if count > split::MAX_PARTS || no >= count {
            return Err(Error::InvalidModel(format!("{shown} says it is part {} of {count}: not a split set hearth can read", no + 1)));
        }
        let paths = split::part_paths(path, no, count).ok_or_else(|| {
            Error::InvalidModel(format!(
                "{shown} is part {} of a model split into {count} files, but its name does not follow the NAME-{:05}-of-{count:05}.gguf scheme its other parts are found by",
                no + 1,
                no + 1
            ))
        })?;
        let mut first = Some(first);
        let mut opened = Vec::with_capacity(paths.len());
        for (k, p) in paths.iter().enumerate() {
            let part = if k as u64 == no {
                first.take().expect("taken once")
            } else {
                open_one(p).map_err(|e| match e {
                    Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => Error::InvalidModel(format!(
                        "{} is missing: {shown} is part {} of a model split into {count} files, and every part must be in the same folder",
                        p.display(),
                        no + 1
                    )),
                    Error::InvalidGguf { offset, reason } => Error::InvalidModel(format!("{} (part {} of {count}): invalid GGUF at byte {offset}: {reason}", p.display(), k + 1)),
                    e => e,
                })?
            };
            if split_of(&part.meta) != Some((k as u64, count)) {
                return Err(Error::InvalidModel(format!(
                    "{} should be part {} of {count} of a split model, but its header says {}",
                    p.display(),
                    k + 1,
                    match split_of(&part.meta) {
                        Some((n, c)) => format!("part {} of {c}", n + 1),
                        None => "it is a whole model".into(),
                    }
                )));
            }
            opened.push(part);
        }
        let file = Self::map_parts(opened)?;
        let total = file.meta.tensors().len() as u64;
        if let Some(listed) = file.meta.get(SPLIT_TENSORS_COUNT).and_then(Value::as_u64) {
            if listed != total {
                return Err(Error::InvalidModel(format!("{shown}: the split set's parts hold {total} tensors, its first part says {listed}")));
            }
        }
        Ok(file)
    }

    /// Maps the parts side by side and merges their tensors into the first part's metadata.
    fn map_parts(opened: Vec<Opened>) -> Result<GgufFile> {
        let page = super::faults::page_size() as u64;
        let align = PART_ALIGNMENT.max(page);
        let mut bases = Vec::with_capacity(opened.len());
        let mut end = 0u64;
        for o in &opened {
            let base = end.div_ceil(align) * align;
            bases.push(base);
            end = base + o.opened.0;
        }
        let len = usize::try_from(end).map_err(|_| Error::InvalidModel("the model is larger than this machine's address space".into()))?;
        let reserved = (len.div_ceil(page as usize) * page as usize).max(page as usize);
        // SAFETY: a fresh private reservation, read-only and never written: it holds the
        // addresses the parts are mapped at, and the space between parts reads as zero
        // pages (a read there, a range that spans two parts, faults nothing). The whole
        // of it is unmapped on drop. A huge page more than needed is reserved, then cut so
        // that it starts on a huge-page boundary.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), reserved + HUGE_PAGE, libc::PROT_READ, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE, -1, 0) };
        if ptr == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(Error::Io { path: opened[0].path.clone(), source: e });
        }
        let head = (HUGE_PAGE - ptr as usize % HUGE_PAGE) % HUGE_PAGE;
        // SAFETY: both ranges lie inside the reservation just made and are not used.
        let ptr = unsafe {
            if head > 0 {
                libc::munmap(ptr, head);
            }
            let ptr = ptr.cast::<u8>().add(head);
            libc::munmap(ptr.add(reserved).cast(), HUGE_PAGE - head);
            ptr
        };
        let region = Region { ptr, reserved, len };
        let data0 = opened[0].meta.data_offset();
        let mut tensors: Vec<TensorInfo> = Vec::new();
        let mut parts = Vec::with_capacity(opened.len());
        let mut first_meta = None;
        for (o, &base) in opened.into_iter().zip(&bases) {
            use std::os::fd::AsRawFd;
            let part_len = o.opened.0;
            if part_len > 0 {
                // SAFETY: the target lies inside the reservation above (bases were laid out
                // within `reserved`); MAP_FIXED replaces only those reserved pages.
                let at = unsafe { region.ptr.add(base as usize) };
                let mapped = unsafe { libc::mmap(at.cast(), part_len as usize, libc::PROT_READ, libc::MAP_SHARED | libc::MAP_FIXED, o.file.as_raw_fd(), 0) };
                if mapped == libc::MAP_FAILED {
                    return Err(Error::Io { path: o.path, source: std::io::Error::last_os_error() });
                }
            }
            // Each part in a slot of its own: a fault zeroes the rest of that part only.
            let watch = Watch::register(unsafe { region.ptr.add(base as usize) }, part_len as usize);
            let shift = base + o.meta.data_offset() - data0;
            tensors.extend(o.meta.tensors().iter().map(|t| TensorInfo { offset: t.offset + shift, ..t.clone() }));
            parts.push(Part { path: o.path, watch, file: o.file, opened: o.opened, base, len: part_len, header_len: o.meta.data_offset() });
            if first_meta.is_none() {
                first_meta = Some(o.meta);
            }
        }
        let first_meta = first_meta.expect("at least one part");
        let meta = if parts.len() == 1 {
            first_meta
        } else {
            first_meta.with_tensors(tensors).map_err(|why| Error::InvalidModel(format!("{}: {why}", parts[0].path.display())))?
        };
        Ok(GgufFile { parts, region, meta })
    }

    /// Why a file of the model is no longer what was mapped, if one is not: written to or
    /// truncated since it was opened (a new version copied over it), or a read of its
    /// mapping faulted. What was read since may be garbage: serve nothing more from it.
    /// A file replaced by a rename (a new file at the path) is not a change: the mapping
    /// keeps the old one.
    pub fn changed(&self) -> Option<String> {
        self.parts.iter().find_map(Part::changed)
    }

    /// The file opened (the first part of a split set).
    pub fn path(&self) -> &Path {
        &self.parts[0].path
    }

    /// The model's files in order: one, or every part of a split set.
    pub fn parts(&self) -> &[Part] {
        &self.parts
    }

    /// The parts of the files a range of [`bytes`](Self::bytes) covers, as file offsets.
    pub fn file_ranges(&self, range: Range<usize>) -> impl Iterator<Item = (&Part, Range<u64>)> {
        let (start, end) = (range.start as u64, range.end as u64);
        self.parts.iter().filter_map(move |p| {
            let (s, e) = (start.max(p.base), end.min(p.base + p.len));
            (s < e).then(|| (p, s - p.base..e - p.base))
        })
    }

    pub fn meta(&self) -> &GgufMeta {
        &self.meta
    }

    /// The whole model: every part at its base, the space between one part's end and the
    /// next part's base reading as zeros.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: [ptr, ptr + len) is reserved readable: the parts' mappings, and zero
        // pages between them; it lives as long as self.
        unsafe { std::slice::from_raw_parts(self.region.ptr, self.region.len) }
    }

    /// Where the first part's tensor data starts; every tensor's offset is relative to it.
    pub fn data_offset(&self) -> u64 {
        self.meta.data_offset()
    }

    /// The tensor's bytes, borrowed from the mapping. For a `TensorInfo` of this file
    /// parse proved the range is inside it; one from another file whose range does
    /// not fit this mapping gets an empty slice rather than a panic.
    pub fn tensor_bytes(&self, t: &TensorInfo) -> &[u8] {
        let start = self.meta.data_offset().checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.n_bytes));
        let range = start.zip(end).and_then(|(s, e)| Some(usize::try_from(s).ok()?..usize::try_from(e).ok()?));
        range.and_then(|r| self.bytes().get(r)).unwrap_or(&[])
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta.get(key)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.meta.get_str(key)
    }

    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.meta.get_u64(key)
    }

    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.meta.get_f32(key)
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        self.meta.tensors()
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.meta.tensor(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_reports_missing_files_with_their_path() {
        let path = std::env::temp_dir().join(format!("gguf-missing-{}.gguf", std::process::id()));
        match GgufFile::open(&path) {
            Err(Error::Io { path: p, .. }) => assert_eq!(p, path),
            other => panic!("expected Io error, got {other:?}"),
        }
    }
}
