//! Computed prompt prefixes kept beyond the slots: blocks of `BLOCK_TOKENS` positions'
//! K/V rows, keyed by their content, in a RAM budget and (with a directory) on disk, where
//! they survive a restart. Any request whose prompt starts with a stored chain of blocks
//! gets their rows written into its slot instead of computing them (see the batcher's
//! `restore_blocks`): agents resending a long system prompt and tools, a conversation
//! coming back after its slot was reused, the same documents asked about again.
//!
//! A block's id chains every token before it and the namespace: the model file's
//! fingerprint, what a block of rows holds (layers, K/V types and widths) and how the rows
//! were computed. A block of another model file, cache type or plan simply misses. Disk
//! files are written to a temporary name, synced and renamed, and carry a MAC of
//! everything they hold under a key of this cache directory's own (`key`, readable by its
//! owner alone): a crash, a damaged file or one changed by anyone without the key (its
//! checksum recomputed) is a miss, never rows read as valid. The directory and its files
//! are the owner's alone (0700, 0600: a block holds a prompt's tokens in clear), a block
//! is read only from a regular file opened without following links or waiting on a FIFO,
//! and a namespace folder that is a link is not written through.
//!
//! Owned by the batching loop (one thread); only disk writes and removals go to a writer
//! thread, in order, so that a request never waits on a disk write.

use std::collections::HashMap;
use std::fs;
use std::io::Read;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::time::{Instant, SystemTime};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::metrics as m;

/// Positions per block: one of the attention's 64-row tiles, the smallest that keeps the
/// exactness rule (rows reused in whole tiles; the rest computed in tiles as a cold prompt
/// computes it). A restore ends on a block's end at least a tile before the prompt's end,
/// so a prompt computes 64 to 127 tokens past its stored prefix whatever its length: a
/// restart costs an agent's ~12k-token prefix what ~100 tokens take, where 256-token
/// blocks left up to 319 (a 2,854-token prompt's first token took 0.16x its cold time
/// after a restart). A block of a 70B model's rows is ~20 MB, of the default model's
/// ~1.5 MB; a prompt looks up one id per 64 tokens (hashing, no I/O until a hit).
pub const BLOCK_TOKENS: usize = 64;

/// A model with a recurrent state keeps the state with a block only every this many
/// blocks (every 1,024 tokens, and at the last whole block a restore of the prompt
/// reaches), every block's rows alone: a state is far bigger than a block's rows
/// (Qwen3.5-35B-A3B: ~63 MB against ~1.3 MB), so this keeps the disk and the prompt's
/// stops to read a state few, and a restore that ends before a prompt's last whole block
/// (another conversation sharing part of it) gives back up to 15 blocks fewer than one
/// with a state at every block.
pub const STATE_EVERY_BLOCKS: usize = 16;

/// Identifies a disk file as a block of this format (and its version). Version 2: a keyed
/// MAC instead of a checksum (version 1 files are misses, removed when met).
const MAGIC: &[u8; 8] = b"HRTHBLK2";

/// The cache directory's MAC key, 32 random bytes made by the first server to use the
/// directory, readable by its owner alone.
const KEY_FILE: &str = "key";

type HmacSha256 = Hmac<Sha256>;

/// Temporary files (`process::write_atomically`'s `<name>.tmp.<pid>`) older than this in
/// the cache directory are what a crash left: removed at start. Younger ones may be another
/// server's writes in progress.
const STALE_TEMP: std::time::Duration = std::time::Duration::from_secs(3600);

pub type BlockId = [u8; 32];

/// A file header's bytes before the block's tokens: magic, namespace, id, token count, rows'
/// length and MAC.
const HEADER_FIXED: usize = 8 + 32 + 32 + 4 + 8 + 32;

/// Where blocks are kept and how much of them (`--prompt-cache-ram`, `--prompt-cache-dir`,
/// `--prompt-cache-size`).
#[derive(Debug, Clone, PartialEq)]
pub struct PrefixCacheConfig {
    /// RAM for blocks beyond the slots, bytes; 0: none kept in RAM.
    pub ram_bytes: u64,
    /// The directory blocks are written to and read back from; `None`: RAM only.
    pub dir: Option<PathBuf>,
    /// Bytes of blocks kept on disk (least recently used go first); 0: no disk.
    pub disk_bytes: u64,
}

impl PrefixCacheConfig {
    pub fn off() -> PrefixCacheConfig {
        PrefixCacheConfig { ram_bytes: 0, dir: None, disk_bytes: 0 }
    }

    pub fn enabled(&self) -> bool {
        self.ram_bytes > 0 || self.disk()
    }

    fn disk(&self) -> bool {
        self.dir.is_some() && self.disk_bytes > 0
    }
}

/// The default directory: `prompt-cache` in hearth's cache folder.
pub fn default_dir() -> Option<PathBuf> {
    crate::process::cache_dir().map(|d| d.join("prompt-cache"))
}

/// The namespace of blocks computed by one model file, layout and way of computing:
/// `parts` are hashed in order.
pub fn namespace(parts: &[&str]) -> BlockId {
    let mut h = Sha256::new();
    h.update(b"hearth prompt blocks v1");
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p.as_bytes());
    }
    h.update((BLOCK_TOKENS as u64).to_le_bytes());
    h.finalize().into()
}

struct RamBlock {
    rows: Arc<Vec<u8>>,
    last_used: u64,
}

struct DiskFile {
    size: u64,
    last_used: u64,
}

enum DiskOp {
    /// The header (and its MAC of the rows) is made on the writer thread: hashing a
    /// block is milliseconds per MB, not for the batching loop.
    Write { path: PathBuf, key: [u8; 32], namespace: BlockId, id: BlockId, tokens: Vec<i32>, rows: Arc<Vec<u8>> },
    Remove(PathBuf),
}

struct Disk {
    root: PathBuf,
    /// The directory's MAC key (`KEY_FILE`).
    key: [u8; 32],
    /// The namespace's files: `root/<namespace hex>/<id hex>`.
    dir: PathBuf,
    budget: u64,
    used: u64,
    /// Every block file under the root, this namespace's and others' (older models, other
    /// cache types): all share the budget, the least recently used going first.
    files: HashMap<PathBuf, DiskFile>,
    writer: Option<mpsc::Sender<DiskOp>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Measured read speed, bytes per second (a running mean); 0 before the first read.
    read_rate: f64,
}

pub struct PrefixCache {
    /// What blocks are read and written now; `None`: none (the pipeline cannot give its
    /// rows at the moment: a ring that is not formed).
    namespace: Option<BlockId>,
    ram: HashMap<BlockId, RamBlock>,
    ram_used: u64,
    ram_budget: u64,
    disk: Option<Disk>,
    clock: u64,
}

impl PrefixCache {
    /// A cache whose disk part indexes what the directory holds (from earlier runs too),
    /// for blocks of no namespace yet (see [`PrefixCache::set_namespace`]). `None` when
    /// `cfg` keeps nothing.
    pub fn open(cfg: &PrefixCacheConfig) -> Option<PrefixCache> {
        if !cfg.enabled() {
            return None;
        }
        let disk = match cfg.dir.as_ref().filter(|_| cfg.disk()) {
            Some(root) => match Disk::open(root, cfg.disk_bytes) {
                Ok(d) => Some(d),
                Err(e) => {
                    tracing::warn!(dir = %root.display(), "prompt cache: the directory cannot be used ({e}); blocks are kept in RAM only");
                    None
                }
            },
            None => None,
        };
        if let Some(d) = &disk {
            tracing::info!(dir = %d.root.display(), blocks = d.files.len(), bytes = d.used, budget = d.budget, "prompt cache on disk");
        }
        // Files found on disk were used before anything this run uses.
        let clock = disk.as_ref().map_or(0, |d| d.files.len() as u64);
        let cache = PrefixCache { namespace: None, ram: HashMap::new(), ram_used: 0, ram_budget: cfg.ram_bytes, disk, clock };
        cache.export();
        Some(cache)
    }

    /// [`PrefixCache::open`] for blocks of `namespace`.
    pub fn open_for(namespace: BlockId, cfg: &PrefixCacheConfig) -> Option<PrefixCache> {
        let mut c = PrefixCache::open(cfg)?;
        c.set_namespace(Some(namespace));
        Some(c)
    }

    /// Blocks of `namespace` from now on (another model file, layout or way of computing:
    /// what RAM holds goes; the disk keeps every namespace's files under one budget);
    /// `None`: no blocks for now.
    pub fn set_namespace(&mut self, namespace: Option<BlockId>) {
        if namespace == self.namespace {
            return;
        }
        self.namespace = namespace;
        self.ram.clear();
        self.ram_used = 0;
        if let (Some(ns), Some(d)) = (namespace, self.disk.as_mut()) {
            d.dir = d.root.join(hex(&ns));
            if let Err(e) = own_dir(&d.dir) {
                tracing::warn!(dir = %d.dir.display(), "prompt cache: the directory cannot be used ({e}); blocks are kept in RAM only");
                self.disk = None;
            }
        }
        self.export();
    }

    /// Whether blocks are read and written now.
    pub fn active(&self) -> bool {
        self.namespace.is_some()
    }

    /// The ids of `tokens`' whole blocks, in order: each names its block's tokens and
    /// everything before them.
    pub fn chain(&self, tokens: &[i32]) -> Vec<BlockId> {
        let Some(mut prev) = self.namespace else { return Vec::new() };
        tokens
            .chunks_exact(BLOCK_TOKENS)
            .map(|block| {
                let mut h = Sha256::new();
                h.update(prev);
                for t in block {
                    h.update(t.to_le_bytes());
                }
                prev = h.finalize().into();
                prev
            })
            .collect()
    }

    /// Whether block `id` is kept (in RAM or on disk).
    pub fn contains(&self, id: &BlockId) -> bool {
        self.ram.contains_key(id) || self.disk.as_ref().is_some_and(|d| d.files.contains_key(&d.path(id)))
    }

    /// The id under which block `id` is kept with a recurrent state where it ends (the
    /// rows alone are kept under `id`).
    pub fn with_state(id: &BlockId) -> BlockId {
        let mut h = Sha256::new();
        h.update(id);
        h.update(b"with the recurrent state");
        h.finalize().into()
    }

    /// Bytes reading block `id` takes from disk: 0 where it is in RAM (or not kept).
    pub fn disk_bytes(&self, id: &BlockId) -> u64 {
        if self.ram.contains_key(id) {
            return 0;
        }
        self.disk.as_ref().and_then(|d| d.files.get(&d.path(id))).map_or(0, |f| f.size)
    }

    /// Whether block `id` is in RAM (reading it costs nothing measurable).
    pub fn in_ram(&self, id: &BlockId) -> bool {
        self.ram.contains_key(id)
    }

    /// The disk's measured read speed, bytes per second; `None` before a read.
    pub fn disk_read_rate(&self) -> Option<f64> {
        self.disk.as_ref().map(|d| d.read_rate).filter(|&r| r > 0.0)
    }

    /// Block `id`'s rows, which hold `tokens`: from RAM, or read from disk (checked: its
    /// namespace, id, tokens and checksum) and kept in RAM then. `None`: not kept, or its
    /// file is damaged (and removed).
    pub fn get(&mut self, id: &BlockId, tokens: &[i32]) -> Option<Arc<Vec<u8>>> {
        self.clock += 1;
        let now = self.clock;
        if let Some(b) = self.ram.get_mut(id) {
            b.last_used = now;
            m::prefix_cache_hit("ram", 0);
            return Some(b.rows.clone());
        }
        let disk = self.disk.as_mut()?;
        let path = disk.path(id);
        let entry = disk.files.get_mut(&path)?;
        entry.last_used = now;
        let started = Instant::now();
        match read_block(&path, &disk.key, &self.namespace?, id, tokens) {
            Ok(rows) => {
                let s = started.elapsed().as_secs_f64().max(1e-6);
                let rate = rows.len() as f64 / s;
                disk.read_rate = if disk.read_rate == 0.0 { rate } else { disk.read_rate + 0.25 * (rate - disk.read_rate) };
                m::prefix_cache_hit("disk", rows.len());
                let rows = Arc::new(rows);
                self.keep_in_ram(*id, rows.clone());
                self.export();
                Some(rows)
            }
            Err(e) => {
                tracing::warn!(file = %path.display(), "prompt cache: a block file is not usable ({e}); removed");
                disk.forget(&path);
                self.export();
                None
            }
        }
    }

    /// Keeps block `id` (whose rows hold `tokens`): in RAM within its budget, and written
    /// to disk (by the writer thread) unless it is there already.
    pub fn put(&mut self, id: BlockId, tokens: &[i32], rows: Vec<u8>) {
        self.clock += 1;
        let rows = Arc::new(rows);
        let Some(namespace) = self.namespace else { return };
        if let Some(disk) = self.disk.as_mut() {
            let path = disk.path(&id);
            if !disk.files.contains_key(&path) {
                let size = (HEADER_FIXED + 4 * tokens.len() + rows.len()) as u64;
                disk.files.insert(path.clone(), DiskFile { size, last_used: self.clock });
                disk.used += size;
                let key = disk.key;
                disk.send(DiskOp::Write { path, key, namespace, id, tokens: tokens.to_vec(), rows: rows.clone() });
                m::prefix_cache_written(size as usize);
                disk.evict();
            }
        }
        self.keep_in_ram(id, rows);
        self.export();
    }

    /// Drops block `id` from RAM and disk: its rows could not be written back (a ring member
    /// no longer has its part), so it is computed and kept again.
    pub fn forget(&mut self, id: &BlockId) {
        if let Some(b) = self.ram.remove(id) {
            self.ram_used -= b.rows.len() as u64;
        }
        if let Some(d) = self.disk.as_mut() {
            let path = d.path(id);
            d.forget(&path);
        }
        self.export();
    }

    fn keep_in_ram(&mut self, id: BlockId, rows: Arc<Vec<u8>>) {
        let size = rows.len() as u64;
        if size > self.ram_budget || self.ram.contains_key(&id) {
            return;
        }
        while self.ram_used + size > self.ram_budget {
            let Some(oldest) = self.ram.iter().min_by_key(|(_, b)| b.last_used).map(|(k, _)| *k) else { break };
            if let Some(b) = self.ram.remove(&oldest) {
                self.ram_used -= b.rows.len() as u64;
            }
        }
        self.ram_used += size;
        self.ram.insert(id, RamBlock { rows, last_used: self.clock });
    }

    fn export(&self) {
        m::prefix_cache_size("ram", self.ram.len(), self.ram_used);
        if let Some(d) = &self.disk {
            m::prefix_cache_size("disk", d.files.len(), d.used);
        }
    }

    /// Waits for the disk writes sent so far (tests, and a clean shutdown).
    pub fn flush(&mut self) {
        if let Some(d) = self.disk.as_mut() {
            d.writer.take();
            if let Some(t) = d.thread.take() {
                let _ = t.join();
            }
            let (tx, thread) = spawn_writer();
            (d.writer, d.thread) = (Some(tx), Some(thread));
        }
    }
}

impl Drop for PrefixCache {
    fn drop(&mut self) {
        if let Some(d) = self.disk.as_mut() {
            d.writer.take();
            if let Some(t) = d.thread.take() {
                let _ = t.join();
            }
        }
    }
}

impl Disk {
    fn open(root: &Path, budget: u64) -> std::io::Result<Disk> {
        // The root may be a link the operator made (a cache on another disk); what hearth
        // makes inside it is its own.
        fs::DirBuilder::new().recursive(true).mode(0o700).create(root)?;
        private(root, 0o700);
        let key = directory_key(root)?;
        let mut files = HashMap::new();
        let mut used = 0;
        // Every namespace's files, ordered by when they were last used (their times).
        let mut found: Vec<(PathBuf, u64, SystemTime)> = Vec::new();
        for ns in fs::read_dir(root)?.flatten().filter(|e| e.file_type().is_ok_and(|t| t.is_dir())) {
            // Folders and files an earlier version made readable by others become private.
            private(&ns.path(), 0o700);
            for f in fs::read_dir(ns.path())?.flatten() {
                let Ok(meta) = f.metadata() else { continue };
                if meta.is_file() {
                    private(&f.path(), 0o600);
                }
                let name = f.file_name();
                let name = name.to_string_lossy();
                let modified = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                if name.contains(".tmp.") {
                    if modified.elapsed().is_ok_and(|age| age > STALE_TEMP) {
                        let _ = fs::remove_file(f.path());
                    }
                    continue;
                }
                if meta.is_file() && name.len() == 64 {
                    found.push((f.path(), meta.len(), modified));
                }
            }
        }
        found.sort_by_key(|(_, _, t)| *t);
        for (i, (path, size, _)) in found.into_iter().enumerate() {
            used += size;
            files.insert(path, DiskFile { size, last_used: i as u64 });
        }
        let (tx, thread) = spawn_writer();
        let mut disk = Disk { root: root.to_path_buf(), key, dir: root.to_path_buf(), budget, used, files, writer: Some(tx), thread: Some(thread), read_rate: 0.0 };
        disk.evict();
        Ok(disk)
    }

    fn path(&self, id: &BlockId) -> PathBuf {
        self.dir.join(hex(id))
    }

    fn send(&mut self, op: DiskOp) {
        if let Some(w) = &self.writer {
            let _ = w.send(op);
        }
    }

    /// Removes least recently used files until the budget holds.
    fn evict(&mut self) {
        while self.used > self.budget {
            let Some(oldest) = self.files.iter().min_by_key(|(_, f)| f.last_used).map(|(p, _)| p.clone()) else { break };
            self.forget(&oldest);
        }
    }

    fn forget(&mut self, path: &Path) {
        if let Some(f) = self.files.remove(path) {
            self.used -= f.size;
            self.send(DiskOp::Remove(path.to_path_buf()));
        }
    }
}

/// The thread that carries out disk writes and removals in the order they were sent.
fn spawn_writer() -> (mpsc::Sender<DiskOp>, std::thread::JoinHandle<()>) {
    let (tx, rx) = mpsc::channel::<DiskOp>();
    let thread = std::thread::Builder::new()
        .name("hearth-prompt-cache".into())
        .spawn(move || {
            for op in rx {
                match op {
                    DiskOp::Write { path, key, namespace, id, tokens, rows } => {
                        let header = header(&key, &namespace, &id, &tokens, &rows);
                        // Written aside, synced and renamed, never through a link planted in
                        // the directory: a reader sees a whole block or none.
                        if let Err(e) = crate::process::write_parts_atomically(&path, &[&header, &rows]) {
                            tracing::warn!(file = %path.display(), "prompt cache: a block could not be written ({e})");
                        }
                    }
                    DiskOp::Remove(path) => {
                        let _ = fs::remove_file(&path);
                    }
                }
            }
        })
        .expect("spawn the prompt cache's writer");
    (tx, thread)
}

/// A file's header: magic, namespace, id, the block's tokens, the rows' length and MAC.
fn header(key: &[u8; 32], namespace: &BlockId, id: &BlockId, tokens: &[i32], rows: &[u8]) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER_FIXED + tokens.len() * 4);
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(namespace);
    h.extend_from_slice(id);
    h.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
    h.extend_from_slice(&(rows.len() as u64).to_le_bytes());
    let token_bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let tag = block_mac(key, &h, &token_bytes, rows).finalize().into_bytes();
    h.extend_from_slice(&tag);
    h.extend_from_slice(&token_bytes);
    h
}

/// The MAC of a block file: every byte of it but the tag, under the directory's key.
fn block_mac(key: &[u8; 32], fields: &[u8], tokens: &[u8], rows: &[u8]) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(fields);
    mac.update(tokens);
    mac.update(rows);
    mac
}

/// Reads and checks a block file: a regular file (no link followed, no FIFO waited on),
/// every header field what was asked, and its MAC under the directory's key. A block read
/// is used: its file's time becomes now (recently used survives a restart too: file times
/// order eviction).
fn read_block(path: &Path, key: &[u8; 32], namespace: &BlockId, id: &BlockId, tokens: &[i32]) -> std::io::Result<Vec<u8>> {
    let bad = |why: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, why.to_string());
    let mut f = crate::process::open_in_dir(path, crate::process::Open::Read)?;
    let len = f.metadata()?.len();
    let fixed = HEADER_FIXED;
    let mut head = vec![0u8; fixed];
    f.read_exact(&mut head)?;
    if &head[..8] != MAGIC || head[8..40] != namespace[..] || head[40..72] != id[..] {
        return Err(bad("not this block"));
    }
    let n_tokens = u32::from_le_bytes(head[72..76].try_into().expect("4 bytes")) as usize;
    let n_rows = u64::from_le_bytes(head[76..84].try_into().expect("8 bytes"));
    if n_tokens != tokens.len() || len != (fixed + 4 * n_tokens) as u64 + n_rows {
        return Err(bad("truncated or of another length"));
    }
    let mut stored = vec![0u8; 4 * n_tokens];
    f.read_exact(&mut stored)?;
    if stored.chunks_exact(4).zip(tokens).any(|(b, &t)| i32::from_le_bytes(b.try_into().expect("4 bytes")) != t) {
        return Err(bad("other tokens"));
    }
    let mut rows = vec![0u8; usize::try_from(n_rows).map_err(|_| bad("too large"))?];
    f.read_exact(&mut rows)?;
    // Constant time, though nothing here is secret from the reader: it is the key that is.
    block_mac(key, &head[..84], &stored, &rows).verify_slice(&head[84..116]).map_err(|_| bad("its MAC does not match: changed, or written under another key"))?;
    let _ = f.set_modified(SystemTime::now());
    Ok(rows)
}

/// The directory's MAC key: read from `KEY_FILE`, or made (random) and written there,
/// readable by its owner alone, when the directory has none. A key file of another size is
/// replaced (every block under the old key then misses).
fn directory_key(root: &Path) -> std::io::Result<[u8; 32]> {
    let path = root.join(KEY_FILE);
    let read = || -> std::io::Result<Option<[u8; 32]>> {
        match crate::process::open_in_dir(&path, crate::process::Open::Read) {
            Ok(mut f) => {
                let mut bytes = Vec::new();
                f.read_to_end(&mut bytes)?;
                Ok(<[u8; 32]>::try_from(bytes.as_slice()).ok())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    };
    if let Some(key) = read()? {
        return Ok(key);
    }
    let key: [u8; 32] = rand::random();
    crate::process::write_atomically(&path, &key)?;
    // Another server sharing the directory may have written its key at once: the one on
    // disk is the one every server reads from now on.
    Ok(read()?.unwrap_or(key))
}

/// A namespace folder: made (the owner's alone), and used only if it is a folder itself,
/// not a link to one planted in the directory (writes would go wherever it points).
fn own_dir(dir: &Path) -> std::io::Result<()> {
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    let meta = fs::symlink_metadata(dir)?;
    if !meta.file_type().is_dir() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "it is not a folder (a link?): hearth does not follow links in its folders"));
    }
    private(dir, 0o700);
    Ok(())
}

/// Takes group and other permissions off a file or folder this user owns (one made by an
/// earlier version, or by a umask that shares).
fn private(path: &Path, mode: u32) {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if let Ok(meta) = fs::symlink_metadata(path) {
        if !meta.file_type().is_symlink() && meta.uid() == me && meta.mode() & 0o077 != 0 {
            let _ = fs::set_permissions(path, fs::Permissions::from_mode(mode));
        }
    }
}

use crate::process::hex;

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(n: usize, seed: i32) -> Vec<i32> {
        (0..n as i32).map(|i| i * 7 + seed).collect()
    }

    fn temp_dir(what: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("hearth-prefix-cache-{what}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn ids_chain_the_whole_prefix_and_the_namespace() {
        let cfg = PrefixCacheConfig { ram_bytes: 1 << 20, dir: None, disk_bytes: 0 };
        let a = PrefixCache::open_for(namespace(&["model a"]), &cfg).unwrap();
        let b = PrefixCache::open_for(namespace(&["model b"]), &cfg).unwrap();
        let t = tokens(3 * BLOCK_TOKENS + 10, 1);
        let ids = a.chain(&t);
        assert_eq!(ids.len(), 3, "whole blocks only");
        assert_ne!(ids, b.chain(&t), "another namespace, other ids");
        // A change in the first block changes every id after it.
        let mut u = t.clone();
        u[5] += 1;
        let other = a.chain(&u);
        assert!(ids.iter().zip(&other).all(|(x, y)| x != y));
        // A change in the third leaves the first two.
        let mut w = t.clone();
        w[2 * BLOCK_TOKENS] += 1;
        assert_eq!(a.chain(&w)[..2], ids[..2]);
        assert_ne!(a.chain(&w)[2], ids[2]);
    }

    #[test]
    fn ram_keeps_the_most_recently_used_within_its_budget() {
        let cfg = PrefixCacheConfig { ram_bytes: 250, dir: None, disk_bytes: 0 };
        let mut c = PrefixCache::open_for(namespace(&["m"]), &cfg).unwrap();
        let t = tokens(4 * BLOCK_TOKENS, 0);
        let ids = c.chain(&t);
        for (i, id) in ids.iter().take(2).enumerate() {
            c.put(*id, &t[i * BLOCK_TOKENS..(i + 1) * BLOCK_TOKENS], vec![i as u8; 100]);
        }
        // Using the first makes the second the oldest: the third pushes it out.
        assert!(c.get(&ids[0], &t[..BLOCK_TOKENS]).is_some());
        c.put(ids[2], &t[2 * BLOCK_TOKENS..3 * BLOCK_TOKENS], vec![2; 100]);
        assert!(c.contains(&ids[0]) && !c.contains(&ids[1]) && c.contains(&ids[2]));
        // A block larger than the whole budget is not kept.
        c.put(ids[3], &t[3 * BLOCK_TOKENS..], vec![3; 300]);
        assert!(!c.contains(&ids[3]));
    }

    #[test]
    fn blocks_on_disk_survive_a_restart_and_a_damaged_or_foreign_file_is_a_miss() {
        let root = temp_dir("restart");
        let cfg = PrefixCacheConfig { ram_bytes: 0, dir: Some(root.clone()), disk_bytes: 1 << 20 };
        let ns = namespace(&["m", "layout"]);
        let t = tokens(3 * BLOCK_TOKENS, 3);
        let rows: Vec<Vec<u8>> = (0..3).map(|i| (0..1000).map(|j| (i * 31 + j) as u8).collect()).collect();
        let ids = {
            let mut c = PrefixCache::open_for(ns, &cfg).unwrap();
            let ids = c.chain(&t);
            for i in 0..3 {
                c.put(ids[i], &t[i * BLOCK_TOKENS..(i + 1) * BLOCK_TOKENS], rows[i].clone());
            }
            ids
        };
        // Another server (a restart) finds them.
        let mut c = PrefixCache::open_for(ns, &cfg).unwrap();
        for i in 0..3 {
            assert!(c.contains(&ids[i]));
            assert_eq!(c.get(&ids[i], &t[i * BLOCK_TOKENS..(i + 1) * BLOCK_TOKENS]).as_deref(), Some(&rows[i]));
        }
        assert!(c.disk_read_rate().is_some());
        drop(c);
        // One file damaged (a byte of its rows flipped), one cut short, as a crash or a
        // failing disk would leave them: both are misses, and removed.
        let dir = root.join(hex(&ns));
        let flip = dir.join(hex(&ids[1]));
        let mut bytes = fs::read(&flip).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        fs::write(&flip, bytes).unwrap();
        let cut = dir.join(hex(&ids[2]));
        let bytes = fs::read(&cut).unwrap();
        fs::write(&cut, &bytes[..bytes.len() - 10]).unwrap();
        let mut c = PrefixCache::open_for(ns, &cfg).unwrap();
        assert!(c.get(&ids[0], &t[..BLOCK_TOKENS]).is_some());
        assert!(c.get(&ids[1], &t[BLOCK_TOKENS..2 * BLOCK_TOKENS]).is_none());
        assert!(c.get(&ids[2], &t[2 * BLOCK_TOKENS..]).is_none());
        assert!(!c.contains(&ids[1]) && !c.contains(&ids[2]));
        // Asked with other tokens than it holds (a hash collision, in principle): a miss.
        assert!(c.get(&ids[0], &t[BLOCK_TOKENS..2 * BLOCK_TOKENS]).is_none());
        drop(c);
        // Another namespace (another model file, cache type or plan) finds none of them.
        let other = PrefixCache::open_for(namespace(&["m", "other layout"]), &cfg).unwrap();
        assert!(ids.iter().all(|id| !other.contains(id)));
        assert!(other.chain(&t).iter().all(|id| !other.contains(id)));
        drop(other);
        fs::remove_dir_all(&root).ok();
    }

    /// The directory is the owner's own: a block whose rows were changed with the checksum
    /// recomputed (anyone could; only the key's holder can make the MAC) is a miss; a FIFO
    /// put where a block file was is a miss at once, not a hang; a namespace folder that is
    /// a link is not written through; folders and files are the owner's alone (a block
    /// holds a prompt's tokens in clear).
    #[test]
    fn a_changed_block_a_fifo_or_a_linked_folder_is_never_used_and_files_are_private() {
        use std::os::unix::fs::PermissionsExt;
        let root = temp_dir("hostile");
        let cfg = PrefixCacheConfig { ram_bytes: 0, dir: Some(root.clone()), disk_bytes: 1 << 20 };
        let ns = namespace(&["m", "hostile"]);
        let t = tokens(2 * BLOCK_TOKENS, 9);
        let block = |i: usize| (i * BLOCK_TOKENS)..((i + 1) * BLOCK_TOKENS);
        let ids = {
            let mut c = PrefixCache::open_for(ns, &cfg).unwrap();
            let ids = c.chain(&t);
            for i in 0..2 {
                c.put(ids[i], &t[block(i)], vec![i as u8 + 1; 1000]);
            }
            ids
        };
        let dir = root.join(hex(&ns));
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&root), 0o700);
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&root.join(KEY_FILE)), 0o600);
        for id in &ids {
            assert_eq!(mode(&dir.join(hex(id))), 0o600, "a block file");
        }
        // Block 0's rows changed and its old checksum field (a SHA-256 of the rows, what a
        // version 1 reader checked) recomputed.
        let path = dir.join(hex(&ids[0]));
        let mut bytes = fs::read(&path).unwrap();
        let rows_at = bytes.len() - 1000;
        bytes[rows_at..].fill(0xee);
        let digest = Sha256::digest(&bytes[rows_at..]);
        bytes[84..116].copy_from_slice(&digest);
        fs::write(&path, &bytes).unwrap();
        // Block 1's file replaced by a FIFO after the index was made.
        let mut c = PrefixCache::open_for(ns, &cfg).unwrap();
        assert!(c.contains(&ids[0]) && c.contains(&ids[1]));
        let fifo = dir.join(hex(&ids[1]));
        fs::remove_file(&fifo).unwrap();
        let c_path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid C string; mkfifo only makes a file.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let (t0, t1) = (t[block(0)].to_vec(), t[block(1)].to_vec());
        let reader = std::thread::spawn(move || {
            let got = (c.get(&ids[0], &t0).is_some(), c.get(&ids[1], &t1).is_some());
            let _ = tx.send(got);
            c
        });
        // A hang becomes a failure (the bound is generous: the reads take milliseconds).
        let got = rx.recv_timeout(std::time::Duration::from_secs(30)).expect("reading a FIFO in place of a block hung");
        assert_eq!(got, (false, false), "the changed block and the FIFO are misses");
        drop(reader.join().unwrap());
        // A namespace folder that is a link to another folder: nothing is written there.
        let elsewhere = temp_dir("hostile-elsewhere");
        fs::create_dir_all(&elsewhere).unwrap();
        let linked = namespace(&["m", "linked"]);
        std::os::unix::fs::symlink(&elsewhere, root.join(hex(&linked))).unwrap();
        {
            let mut c = PrefixCache::open_for(linked, &cfg).unwrap();
            let ids = c.chain(&t);
            c.put(ids[0], &t[block(0)], vec![7; 1000]);
            c.flush();
        }
        assert_eq!(fs::read_dir(&elsewhere).unwrap().count(), 0, "written through a linked folder");
        fs::remove_dir_all(&root).ok();
        fs::remove_dir_all(&elsewhere).ok();
    }

    #[test]
    fn the_disk_budget_removes_the_least_recently_used_across_restarts() {
        let root = temp_dir("budget");
        let t = tokens(4 * BLOCK_TOKENS, 5);
        let block = |i: usize| (i * BLOCK_TOKENS)..((i + 1) * BLOCK_TOKENS);
        let one = (HEADER_FIXED + 4 * BLOCK_TOKENS + 1000) as u64;
        let cfg = PrefixCacheConfig { ram_bytes: 0, dir: Some(root.clone()), disk_bytes: 3 * one };
        let ns = namespace(&["m"]);
        let ids = {
            let mut c = PrefixCache::open_for(ns, &cfg).unwrap();
            let ids = c.chain(&t);
            for i in 0..3 {
                c.put(ids[i], &t[block(i)], vec![i as u8; 1000]);
            }
            c.flush();
            // Written a minute apart, in order (set, not slept: file times may be as coarse
            // as a second on some file systems, and a host may be slow).
            let dir = root.join(hex(&ns));
            let old = SystemTime::now() - std::time::Duration::from_secs(600);
            for (i, id) in ids.iter().take(3).enumerate() {
                fs::File::options().write(true).open(dir.join(hex(id))).unwrap().set_modified(old + std::time::Duration::from_secs(60 * i as u64)).unwrap();
            }
            // Block 0 used last (its time now): block 1 is the least recently used.
            assert!(c.get(&ids[0], &t[block(0)]).is_some());
            ids
        };
        // After a restart the file times order them: the fourth pushes block 1 out.
        let mut c = PrefixCache::open_for(ns, &cfg).unwrap();
        c.put(ids[3], &t[block(3)], vec![3; 1000]);
        c.flush();
        let dir = root.join(hex(&ns));
        let on_disk: Vec<bool> = ids.iter().map(|id| dir.join(hex(id)).exists()).collect();
        assert_eq!(on_disk, [true, false, true, true]);
        // No temporary file is left behind.
        assert!(fs::read_dir(&dir).unwrap().flatten().all(|e| !e.file_name().to_string_lossy().contains(".tmp.")));
        drop(c);
        fs::remove_dir_all(&root).ok();
    }
}
