//! What the process gets from the operating system, shared by every role: the tokio
//! runtimes (HTTP at lower priority, ring I/O at normal priority), thread priorities,
//! shutdown signals, the OpenMP environment, the wall clock and hearth's cache folder. A
//! leaf: it imports nothing from this crate.

/// The runtime for HTTP work. Its threads run at a lower priority than the engine's: a
/// ggml step waits at a barrier for all its threads, so an HTTP task that preempts one of
/// them stalls the whole step for a scheduler time slice (measured on 2 cores: +34% time
/// per token for a single streaming client). At lower priority the HTTP work runs in the
/// gaps between steps and on cores the engine leaves idle.
pub fn http_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .on_thread_start(|| lower_thread_priority(HTTP_NICE))
        .build()
}

/// The runtime that moves ring frames (the head's links, a worker's links and control
/// calls): normal priority, unlike `http_runtime`. A frame waiting to be written is the
/// whole ring waiting; at nice 10 its thread lost the cores for up to a millisecond to
/// the compute threads still spinning after a step.
pub fn ring_runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("hearth-ring-io").build()
}

/// nice value of HTTP threads (0 is normal, 19 lowest): low enough to yield to the engine
/// under contention, high enough not to starve when the machine is busy elsewhere.
pub const HTTP_NICE: i32 = 10;

pub fn lower_thread_priority(nice: i32) {
    #[cfg(target_os = "linux")]
    // SAFETY: setpriority on this thread's own id; failure only leaves the priority as is.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, nice);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = nice;
}

/// Resolves on SIGTERM or Ctrl-C. The handlers are registered when this is called, not
/// when the future is first polled: a signal that arrives right after "listening" (a
/// supervisor stopping us at once) must shut down gracefully, not kill the process.
pub fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        Ok(async move {
            tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        })
    }
    #[cfg(not(unix))]
    Ok(async {
        let _ = tokio::signal::ctrl_c().await;
    })
}


/// This machine's host name (Linux), for naming devices in profiles and discovery.
pub fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname").ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

/// Seconds since the Unix epoch (OpenAI's `created` fields, plan and cluster views).
pub fn now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// How long (in pause instructions) an idle OpenMP thread spins before it sleeps, unless
/// the user set `GOMP_SPINCOUNT`. libgomp's default (300,000, i.e. milliseconds on CPUs
/// whose pause takes ~100 cycles) keeps a ring member's threads burning cores after its
/// window is done, while the next member on the same machine needs them. Waits inside a
/// step (ggml's per-op barriers) last microseconds, well within this.
const OPENMP_SPIN_COUNT: &str = "10000";

/// libgomp reads its settings once, when it is loaded, before `main`: setting them means
/// starting over with the new environment. Returns only if that is not needed or fails.
#[cfg(unix)]
pub fn settle_openmp_environment() {
    use std::os::unix::process::CommandExt;
    if std::env::var_os("GOMP_SPINCOUNT").is_some() || std::env::var_os("OMP_WAIT_POLICY").is_some() {
        return;
    }
    let Ok(exe) = std::env::current_exe() else { return };
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    let err = std::process::Command::new(exe).args(args).env("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT).exec();
    eprintln!("hearth: could not restart with GOMP_SPINCOUNT set ({err}); continuing");
}

#[cfg(not(unix))]
pub fn settle_openmp_environment() {}

/// hearth's folder in the user's cache (`$XDG_CACHE_HOME/hearth`, else `~/.cache/hearth`):
/// measured device profiles and model manifests.
pub fn cache_dir() -> Option<std::path::PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME").map(std::path::PathBuf::from).or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache")))?;
    Some(base.join("hearth"))
}

/// Writes `bytes` to `path` aside and renames it there (making the folder first): another
/// hearth process reading it never sees half a file. The file aside is made new, never
/// through a link planted at its name, and the rename replaces a link at `path` rather
/// than write through it: whoever can write the folder cannot aim hearth's writes outside it.
pub fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    write_parts_atomically(path, &[bytes])
}

/// [`write_atomically`] of `parts` one after another (a header and a body without joining
/// them), synced before the rename: after a power loss the name holds the whole file or
/// what it held before.
pub fn write_parts_atomically(path: &std::path::Path, parts: &[&[u8]]) -> std::io::Result<()> {
    use std::io::Write;
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    path.parent().map_or(Ok(()), std::fs::create_dir_all)?;
    // A leftover of a process that had this id (or anything planted there) goes first.
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut file = open_in_dir(&tmp, Open::CreateNew)?;
    for part in parts {
        file.write_all(part)?;
    }
    file.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// Bytes free to this user on the file system holding `path` (`None` where it cannot be
/// told).
pub fn free_bytes(path: &std::path::Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: a valid C string and a zeroed struct statvfs fills.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_bavail as u64 * st.f_frsize as u64)
}

/// Bytes as lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// How [`open_in_dir`] opens a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Open {
    /// Read and write; created when missing, kept when there.
    ReadWrite,
    /// Write a file that must not exist yet, readable by this user alone: what hearth writes
    /// aside (a prompt's K/V rows and tokens, profiles, manifests) is nobody else's to read.
    CreateNew,
    /// Read a file that exists.
    Read,
}

/// Opens a file hearth writes or reads in a folder it was given (`--model-dir`, its cache,
/// a disk to measure) without following a symbolic link at its name, without waiting on a
/// FIFO, and only if it is a regular file: a link, a FIFO or a device planted there by
/// anyone who can write the folder would otherwise have hearth resize or write whatever
/// it points at, or hang on it.
pub fn open_in_dir(path: &std::path::Path, how: Open) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut options = std::fs::OpenOptions::new();
    match how {
        Open::ReadWrite => options.read(true).write(true).create(true).truncate(false),
        Open::CreateNew => options.write(true).create_new(true).mode(0o600),
        Open::Read => options.read(true),
    };
    // O_NONBLOCK: opening a FIFO planted at the name must not wait for a reader.
    let file = options.custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK).open(path).map_err(|e| {
        if e.raw_os_error() == Some(libc::ELOOP) {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{} is a symbolic link: hearth does not follow links in its folders", path.display()))
        } else {
            e
        }
    })?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{} is not a regular file", path.display())));
    }
    Ok(file)
}
