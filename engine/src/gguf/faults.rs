//! A model file that shrinks under its mapping must not kill the process.
//!
//! Reading a page of a mapping past the end of its file raises SIGBUS, whose default action
//! ends the process without a word: a `cp` of a new version over the served path (it
//! truncates first), or a download resumed into it, would take the head down with every
//! stream it serves. So every model mapping is registered here, and a SIGBUS handler
//! installed once per process looks at the faulting address:
//!
//! - inside a registered mapping: the rest of that mapping from the faulting page on is
//!   replaced by zero pages (`mmap` with `MAP_FIXED`, one system call, the one thing the
//!   handler does besides atomics), the mapping is marked as faulted, and the read resumes,
//!   reading zeros. What was computed from them is garbage, and the owner of the file
//!   learns it at its next check ([`faulted`], `GgufFile::changed`) and refuses to serve
//!   from it (a clear error, a degraded state, a log line);
//! - anywhere else: the default action is restored and the fault repeats, ending the
//!   process as before (a SIGBUS elsewhere is a bug or a hardware fault, not ours to hide).
//!
//! Only `mmap` and atomics run in the handler: no allocation, no lock, no logging.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Once, OnceLock};

/// Mappings watched at once: a process maps its model (one per part of a split set), a
/// draft model and, in tests, a few more; a mapping past this many is served unwatched.
const SLOTS: usize = 256;

struct Slot {
    /// Taken by a registration (set before the fields below are written, so two
    /// registrations never write one slot).
    claimed: AtomicBool,
    /// First byte of the mapping; 0 while the slot is free or being filled.
    start: AtomicUsize,
    len: AtomicUsize,
    faulted: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Slot = Slot { claimed: AtomicBool::new(false), start: AtomicUsize::new(0), len: AtomicUsize::new(0), faulted: AtomicBool::new(false) };
static WATCHED: [Slot; SLOTS] = [FREE; SLOTS];
static INSTALL: Once = Once::new();
/// The action SIGBUS had before (Rust's runtime installs one): what a fault that is not
/// ours goes back to.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// A registered mapping; unregistered when dropped (before the mapping is unmapped).
#[derive(Debug)]
pub struct Watch {
    slot: Option<usize>,
}

impl Watch {
    /// Registers `len` bytes mapped at `start`.
    pub fn register(start: *const u8, len: usize) -> Watch {
        INSTALL.call_once(install);
        if len == 0 {
            return Watch { slot: None };
        }
        for (i, slot) in WATCHED.iter().enumerate() {
            if slot.claimed.compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire).is_err() {
                continue;
            }
            // Length and flag first: the handler reads a slot only once its start is set.
            slot.len.store(len, Ordering::Release);
            slot.faulted.store(false, Ordering::Release);
            slot.start.store(start as usize, Ordering::Release);
            return Watch { slot: Some(i) };
        }
        tracing::warn!("more than {SLOTS} model files mapped: this one is not protected from being truncated while served");
        Watch { slot: None }
    }

    /// Whether a read of this mapping faulted (the file shrank under it).
    pub fn faulted(&self) -> bool {
        self.slot.is_some_and(|i| WATCHED[i].faulted.load(Ordering::Acquire))
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some(i) = self.slot {
            WATCHED[i].start.store(0, Ordering::Release);
            WATCHED[i].claimed.store(false, Ordering::Release);
        }
    }
}

pub(super) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 {
        size as usize
    } else {
        4096
    }
}

static PAGE: AtomicUsize = AtomicUsize::new(4096);

fn install() {
    PAGE.store(page_size(), Ordering::Release);
    // SAFETY: a plain sigaction with a handler that only calls mmap and touches atomics.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigbus as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut action.sa_mask);
        let mut previous: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut previous) == 0 {
            let _ = PREVIOUS.set(previous);
        }
        if libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut()) != 0 {
            tracing::warn!("cannot handle SIGBUS: a model file truncated while served would end the process");
        }
    }
}

extern "C" fn on_sigbus(_signal: libc::c_int, info: *mut libc::siginfo_t, _context: *mut libc::c_void) {
    // SAFETY: the kernel hands a valid siginfo to an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    let page = PAGE.load(Ordering::Acquire);
    for slot in &WATCHED {
        let start = slot.start.load(Ordering::Acquire);
        let len = slot.len.load(Ordering::Acquire);
        if start == 0 || addr < start || addr >= start + len {
            continue;
        }
        let from = addr & !(page - 1);
        let end = (start + len).div_ceil(page) * page;
        // SAFETY: [from, end) lies within a live mapping of ours (registered until it is
        // unmapped); replacing its pages with anonymous zero pages keeps every pointer into
        // it valid.
        let zeroed = unsafe { libc::mmap(from as *mut libc::c_void, end - from, libc::PROT_READ, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED, -1, 0) };
        if zeroed != libc::MAP_FAILED {
            slot.faulted.store(true, Ordering::Release);
            return;
        }
        break;
    }
    // Not ours, or it could not be mended: the action from before takes the repeated
    // fault (the default one ends the process, as SIGBUS always did).
    // SAFETY: restoring an action sigaction itself reported, or the default one.
    unsafe {
        match PREVIOUS.get() {
            Some(previous) => libc::sigaction(libc::SIGBUS, previous, std::ptr::null_mut()),
            None => {
                libc::signal(libc::SIGBUS, libc::SIG_DFL);
                0
            }
        };
    }
}

/// Whether any watched mapping faulted since the process started.
pub fn faulted() -> bool {
    WATCHED.iter().any(|s| s.faulted.load(Ordering::Acquire))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_file_truncated_under_its_mapping_reads_zeros_and_is_marked() {
        let path = std::env::temp_dir().join(format!("hearth-sigbus-{}", std::process::id()));
        let page = page_size();
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(&vec![7u8; 4 * page]).unwrap();
        f.sync_all().unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: the test truncates the file on purpose; the watch below mends the faults.
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        let watch = Watch::register(map.as_ptr(), map.len());
        assert_eq!(map[3 * page], 7);
        assert!(!watch.faulted());
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(page as u64).unwrap();
        // A page past the new end: SIGBUS without the handler. Read through a volatile
        // load so the compiler cannot reuse the earlier read.
        let past = unsafe { std::ptr::read_volatile(map.as_ptr().add(3 * page)) };
        assert_eq!(past, 0);
        assert!(watch.faulted() && faulted());
        // What is still in the file reads as it was.
        assert_eq!(map[0], 7);
        drop(watch);
        drop(map);
        std::fs::remove_file(&path).unwrap();
    }
}
