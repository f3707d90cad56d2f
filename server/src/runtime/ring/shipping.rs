//! The model shipped from the head. A worker without the head's GGUF (or with another one)
//! fetches the file's header and the tensors of its windows, and nothing else, over the
//! authenticated ring transport into a sparse file of its own; every piece is checked
//! against the head's manifest of SHA-256 digests before it is used.
//!
//! - Head: [`ManifestStore`] computes the manifest once (in the background, at start) and
//!   caches it on disk by the model's fingerprint; [`serve_manifest`] and [`serve_range`]
//!   answer the control call `model_manifest` and the blob call `model_range` on the head's
//!   ring listener, where only peers that proved the cluster secret are served.
//! - Worker: [`Shipper`] runs one fetch at a time in the background, asked by the head's
//!   `fetch_model` call (which the head repeats until every worker of a plan is ready, and
//!   which reports progress). A fetch resumes: what a worker verified is recorded beside
//!   the file, checked again when a fetch starts, and only the rest crosses the network.
//!
//! It reads the GGUF through the engine and moves bytes through the transport; it knows
//! nothing of rounds, stages or plans beyond a worker's windows.

use std::collections::{BTreeSet, HashMap};
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use engine::ModelFile;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use transport::{ClusterSecret, ControlClient, ControlFailure, LinkConfig, MAX_BLOB_BYTES};

/// Control method on the head: the manifest.
pub const MANIFEST: &str = "model_manifest";
/// Blob method on the head: bytes `offset..offset+len` of the model file.
pub const RANGE: &str = "model_range";
/// Control method on a worker: fetch (or go on fetching) what these windows need; answers
/// the progress.
pub const FETCH: &str = "fetch_model";

/// A piece of the model file and its digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    pub offset: u64,
    pub bytes: u64,
    /// SHA-256, hex.
    pub sha256: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorPiece {
    pub name: String,
    #[serde(flatten)]
    pub piece: Piece,
}

/// One file of the head's model: its length and its header (everything before its tensor
/// data). The header piece's offset is where the file starts in the model's byte space
/// (`GgufFile::bytes`, the offsets every piece and range use).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FilePiece {
    pub file_bytes: u64,
    pub header: Piece,
}

/// The head's model, piece by piece: every file's header (one file, or each part of a
/// split set) and every tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub fingerprint: String,
    pub files: Vec<FilePiece>,
    pub tensors: Vec<TensorPiece>,
}

/// The name of file `k`'s header in a worker's record of verified pieces.
fn header_name(k: usize) -> String {
    match k {
        0 => "(header)".into(),
        k => format!("(header of part {})", k + 1),
    }
}

use crate::process::hex;

impl Manifest {
    /// Hashes the whole file once (SHA-256 runs at a GB/s or more with the CPU's SHA
    /// instructions), adding the bytes hashed so far to `progress`.
    pub fn compute(file: &ModelFile, progress: &AtomicU64) -> Manifest {
        let bytes = file.gguf.bytes();
        let piece = |offset: u64, data: &[u8]| {
            let digest = Sha256::digest(data);
            progress.fetch_add(data.len() as u64, Ordering::Relaxed);
            Piece { offset, bytes: data.len() as u64, sha256: hex(&digest) }
        };
        let data_offset = file.gguf.data_offset();
        let files = file
            .gguf
            .parts()
            .iter()
            .map(|p| {
                let (start, end) = ((p.base() as usize).min(bytes.len()), ((p.base() + p.header_len()) as usize).min(bytes.len()));
                FilePiece { file_bytes: p.len(), header: piece(p.base(), &bytes[start..end]) }
            })
            .collect();
        let tensors = file
            .gguf
            .meta()
            .tensors()
            .iter()
            .map(|t| TensorPiece { name: t.name.clone(), piece: piece(data_offset + t.offset, file.gguf.tensor_bytes(t)) })
            .collect();
        Manifest { fingerprint: file.fingerprint(), files, tensors }
    }

    /// The tensors by name (a MoE model has thousands).
    fn by_name(&self) -> HashMap<&str, &TensorPiece> {
        self.tensors.iter().map(|t| (t.name.as_str(), t)).collect()
    }

    /// The headers, named as a worker records them.
    fn headers(&self) -> Vec<(String, Piece)> {
        self.files.iter().enumerate().map(|(k, f)| (header_name(k), f.header.clone())).collect()
    }

    /// Whether the files are the ones `file` maps.
    fn describes(&self, file: &ModelFile) -> bool {
        self.files.iter().map(|f| (f.header.offset, f.file_bytes)).eq(file.gguf.parts().iter().map(|p| (p.base(), p.len())))
    }

    /// The pieces a worker of `windows` needs: the headers first, then its tensors.
    fn pieces_for(&self, file: &ModelFile, windows: &[Range<usize>]) -> Result<Vec<(String, Piece)>, String> {
        if !self.describes(file) {
            return Err("the head's manifest lists other files than the headers it sent".into());
        }
        let mut out = self.headers();
        let data_offset = file.gguf.data_offset();
        let by_name = self.by_name();
        for t in engine::model_file::window_tensors(file.gguf.meta(), windows) {
            let listed = by_name.get(t.name.as_str()).ok_or_else(|| format!("the head's manifest lacks tensor {}", t.name))?;
            if listed.piece.offset != data_offset + t.offset || listed.piece.bytes != t.n_bytes {
                return Err(format!("the head's manifest places tensor {} elsewhere than the header does", t.name));
            }
            out.push((t.name.clone(), listed.piece.clone()));
        }
        Ok(out)
    }
}

enum StoreState {
    Computing,
    Ready(Arc<Manifest>),
    Failed(String),
}

/// The head's manifest: read from the cache when this model was hashed before, else
/// computed in the background when a worker first asks (it waits, told how far the
/// hashing is). Not at start: reading a model larger than memory end to end would evict
/// the pages a head serving from disk needs.
pub struct ManifestStore {
    file: Arc<ModelFile>,
    /// `None` until a worker first asks.
    state: Mutex<Option<Arc<Mutex<StoreState>>>>,
    hashed: Arc<AtomicU64>,
    total: u64,
}

impl ManifestStore {
    pub fn new(file: Arc<ModelFile>) -> Arc<ManifestStore> {
        let total = file.gguf.bytes().len() as u64;
        Arc::new(ManifestStore { file, state: Mutex::new(None), hashed: Arc::new(AtomicU64::new(0)), total })
    }

    /// The manifest, or a 503 with how far the hashing is (started by the first call).
    pub fn get(&self) -> Result<Arc<Manifest>, ControlFailure> {
        let state = {
            let mut slot = self.state.lock().unwrap_or_else(|e| e.into_inner());
            match &*slot {
                Some(state) => state.clone(),
                None => {
                    let state = Arc::new(Mutex::new(StoreState::Computing));
                    let (file, hashed, background) = (self.file.clone(), self.hashed.clone(), state.clone());
                    let spawned = std::thread::Builder::new().name("hearth-manifest".into()).spawn(move || {
                        let manifest = load_or_compute(&file, &hashed);
                        *background.lock().unwrap_or_else(|e| e.into_inner()) = StoreState::Ready(Arc::new(manifest));
                    });
                    if let Err(e) = spawned {
                        *state.lock().unwrap_or_else(|e| e.into_inner()) = StoreState::Failed(format!("cannot start hashing the model: {e}"));
                    }
                    *slot = Some(state.clone());
                    state
                }
            }
        };
        let state = state.lock().unwrap_or_else(|e| e.into_inner());
        match &*state {
            StoreState::Ready(m) => Ok(m.clone()),
            StoreState::Failed(e) => Err(ControlFailure::failed(e.clone())),
            StoreState::Computing => {
                let done = self.hashed.load(Ordering::Relaxed) as f64 / self.total.max(1) as f64;
                Err(ControlFailure { status: 503, message: format!("{COMPUTING}: {:.0}% hashed", done * 100.0) })
            }
        }
    }
}

/// How a head says it is still hashing: the worker waits and asks again.
const COMPUTING: &str = "the head is computing the model's manifest";

fn manifest_cache(fingerprint: &str) -> Option<PathBuf> {
    Some(crate::process::cache_dir()?.join("manifests").join(format!("{fingerprint}.json")))
}

fn load_or_compute(file: &ModelFile, progress: &AtomicU64) -> Manifest {
    let fingerprint = file.fingerprint();
    let cache = manifest_cache(&fingerprint);
    let cached = cache.as_ref().and_then(|p| std::fs::read(p).ok()).and_then(|b| serde_json::from_slice::<Manifest>(&b).ok());
    if let Some(m) = cached.filter(|m| m.fingerprint == fingerprint && m.describes(file)) {
        tracing::info!("model manifest read from the cache");
        return m;
    }
    let started = Instant::now();
    let manifest = Manifest::compute(file, progress);
    tracing::info!(tensors = manifest.tensors.len(), seconds = started.elapsed().as_secs_f64(), "model manifest computed (SHA-256 of every tensor), for workers that fetch the model from this head");
    if let Some(path) = cache {
        if let Err(e) = crate::process::write_atomically(&path, &serde_json::to_vec(&manifest).unwrap_or_default()) {
            tracing::warn!("could not cache the model manifest in {}: {e}", path.display());
        }
    }
    manifest
}

/// The head's answer to `model_manifest`.
pub fn serve_manifest(store: &ManifestStore) -> Result<Value, ControlFailure> {
    let manifest = store.get()?;
    serde_json::to_value(&*manifest).map_err(|e| ControlFailure::failed(e.to_string()))
}

/// The head's answer to `model_range {offset, len}`: those bytes of its model file.
pub async fn serve_range(file: Arc<ModelFile>, body: Value) -> Result<Bytes, ControlFailure> {
    let offset = body["offset"].as_u64().ok_or_else(|| ControlFailure::bad_request("model_range needs an offset"))?;
    let len = body["len"].as_u64().ok_or_else(|| ControlFailure::bad_request("model_range needs a len"))?;
    if len > MAX_BLOB_BYTES as u64 {
        return Err(ControlFailure::bad_request(format!("at most {MAX_BLOB_BYTES} bytes per range")));
    }
    let size = file.gguf.bytes().len() as u64;
    let end = offset.checked_add(len).filter(|&e| e <= size).ok_or_else(|| ControlFailure::bad_request(format!("the range is past the end of the model file ({size} bytes)")))?;
    // Reading pages of a model not in memory waits on the disk: off the runtime.
    // The file checked before and after the copy: a range read while it changed (a new
    // version copied over it) is not the model the manifest describes.
    let changed = |file: &ModelFile| file.gguf.changed().map(|why| ControlFailure::failed(format!("the head cannot ship its model: {why}")));
    if let Some(e) = changed(&file) {
        return Err(e);
    }
    let (bytes, file) = tokio::task::spawn_blocking(move || (Bytes::copy_from_slice(&file.gguf.bytes()[offset as usize..end as usize]), file))
        .await
        .map_err(|e| ControlFailure::failed(e.to_string()))?;
    if let Some(e) = changed(&file) {
        return Err(e);
    }
    crate::metrics::model_bytes_served(len);
    Ok(bytes)
}

/// What the head asks a worker to fetch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FetchRequest {
    pub fingerprint: String,
    /// The head's ring listener, as this worker reaches it.
    pub source: String,
    pub windows: Vec<(usize, usize)>,
}

/// A worker's answer to `fetch_model`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct FetchStatus {
    /// Every piece the windows need is here and verified.
    pub ready: bool,
    /// Bytes of the header and the windows' tensors.
    pub needed_bytes: u64,
    /// Of those, verified on this worker.
    pub verified_bytes: u64,
    /// Bytes received from the head by this fetch (pieces fetched again included).
    pub fetched_bytes: u64,
    /// Pieces whose bytes did not match the manifest and were fetched again.
    pub refused_pieces: u64,
    /// Why the fetch stopped; the head's next call starts it again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// A fetch's progress, shared with the task that does it.
#[derive(Default)]
struct Progress {
    needed: AtomicU64,
    verified: AtomicU64,
    fetched: AtomicU64,
    refused: AtomicU64,
    done: AtomicBool,
    error: Mutex<Option<String>>,
    file: Mutex<Option<Arc<ModelFile>>>,
}

impl Progress {
    fn status(&self) -> FetchStatus {
        let error = self.error.lock().unwrap_or_else(|e| e.into_inner()).clone();
        FetchStatus {
            ready: self.done.load(Ordering::Acquire) && error.is_none(),
            needed_bytes: self.needed.load(Ordering::Relaxed),
            verified_bytes: self.verified.load(Ordering::Relaxed),
            fetched_bytes: self.fetched.load(Ordering::Relaxed),
            refused_pieces: self.refused.load(Ordering::Relaxed),
            error,
        }
    }
}

struct Job {
    request: FetchRequest,
    progress: Arc<Progress>,
    task: tokio::task::JoinHandle<()>,
}

/// A worker's fetches: where shipped models go, how much disk they may take, the one
/// fetch under way.
pub struct Shipper {
    dir: PathBuf,
    budget: Option<u64>,
    secret: ClusterSecret,
    job: Mutex<Option<Job>>,
}

/// Pieces verified between two writes of the record: a crash re-fetches at most these.
const RECORD_EVERY: Duration = Duration::from_secs(1);
/// A piece that arrives wrong this many times in a row stops the fetch (the head's file
/// changed under it, or something on the path corrupts every copy).
const PIECE_ATTEMPTS: u32 = 3;
/// A lost link is retried this many times, with this pause, before the fetch stops.
const LINK_ATTEMPTS: u32 = 5;
const LINK_RETRY: Duration = Duration::from_secs(1);
/// How often progress is logged.
const LOG_EVERY: Duration = Duration::from_secs(5);
/// Width of the progress bar drawn on a terminal.
const BAR_WIDTH: usize = 30;

impl Shipper {
    pub fn new(dir: PathBuf, budget: Option<u64>, secret: ClusterSecret) -> Shipper {
        Shipper { dir, budget, secret, job: Mutex::new(None) }
    }

    /// Where fetched models go.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Starts fetching what `request` needs (or goes on with the same fetch), and says how
    /// far it is. A finished fetch also hands over the opened model file.
    pub fn fetch(&self, request: FetchRequest) -> (FetchStatus, Option<Arc<ModelFile>>) {
        let mut job = self.job.lock().unwrap_or_else(|e| e.into_inner());
        let same = job.as_ref().is_some_and(|j| j.request == request);
        let failed = job.as_ref().is_some_and(|j| j.progress.error.lock().unwrap_or_else(|e| e.into_inner()).is_some());
        if same && failed {
            // Said once; the next call starts it again (the link may be back, room made).
            let status = job.take().expect("checked").progress.status();
            return (status, None);
        }
        if !same {
            if let Some(old) = job.take() {
                old.task.abort();
            }
            let progress = Arc::new(Progress::default());
            let task = tokio::spawn(run_fetch(request.clone(), self.dir.clone(), self.budget, self.secret.clone(), progress.clone()));
            *job = Some(Job { request, progress, task });
        }
        let progress = &job.as_ref().expect("set above").progress;
        let status = progress.status();
        let file = if status.ready { progress.file.lock().unwrap_or_else(|e| e.into_inner()).clone() } else { None };
        (status, file)
    }
}

async fn run_fetch(request: FetchRequest, dir: PathBuf, budget: Option<u64>, secret: ClusterSecret, progress: Arc<Progress>) {
    let result = fetch(&request, &dir, budget, &secret, &progress).await;
    match result {
        Ok(file) => {
            *progress.file.lock().unwrap_or_else(|e| e.into_inner()) = Some(file);
            progress.done.store(true, Ordering::Release);
        }
        Err(e) => {
            tracing::warn!("fetching the model from the head stopped: {e}");
            *progress.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
            progress.done.store(true, Ordering::Release);
        }
    }
}

/// Where a shipped model lives in `dir`: its files (one, or a split set's parts named as
/// llama.cpp names them), the head's manifest, and the record of verified pieces.
struct Paths {
    stem: String,
    files: Vec<PathBuf>,
    manifest: PathBuf,
    record: PathBuf,
}

fn paths(dir: &Path, fingerprint: &str, files: usize) -> Paths {
    // Only hex digits reach the name: whatever a manifest says, the file stays in `dir`.
    let short: String = fingerprint.chars().filter(char::is_ascii_hexdigit).take(16).collect();
    let stem = format!("shipped-{short}");
    let files = match files {
        0 | 1 => vec![dir.join(format!("{stem}.gguf"))],
        n => (1..=n as u64).map(|k| dir.join(engine::gguf::split::part_name(&stem, k, n as u64))).collect(),
    };
    Paths { files, manifest: dir.join(format!("{stem}.manifest.json")), record: dir.join(format!("{stem}.verified.json")), stem }
}

/// Bytes a file takes on disk (a sparse file: only what was written).
fn allocated(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map_or(0, |m| m.blocks() * 512)
}

/// The shipped model a file in `dir` belongs to (`shipped-…`, without the part and the
/// extension), if it is one.
fn shipped_stem(name: &str) -> Option<&str> {
    let stem = engine::gguf::split::split_part(name).map(|(prefix, _, _)| prefix).or_else(|| name.strip_suffix(".gguf"))?;
    stem.starts_with("shipped-").then_some(stem)
}

/// Makes room in `dir` for `needed` more bytes under `budget`: other shipped models go,
/// least recently used first. An error when even that is not enough.
fn make_room(dir: &Path, keep: &Paths, needed: u64, budget: u64) -> Result<(), String> {
    // Each shipped model: its files, their disk use, its last use (its newest file).
    let mut models: HashMap<String, (std::time::SystemTime, Vec<PathBuf>)> = HashMap::new();
    for path in std::fs::read_dir(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?.flatten().map(|e| e.path()) {
        let Some(stem) = path.file_name().and_then(|n| n.to_str()).and_then(shipped_stem) else { continue };
        if stem == keep.stem {
            continue;
        }
        let modified = std::fs::metadata(&path).and_then(|m| m.modified()).unwrap_or(std::time::UNIX_EPOCH);
        let entry = models.entry(stem.to_string()).or_insert((std::time::UNIX_EPOCH, Vec::new()));
        entry.0 = entry.0.max(modified);
        entry.1.push(path);
    }
    let mut others: Vec<(std::time::SystemTime, String, Vec<PathBuf>)> = models.into_iter().map(|(stem, (t, files))| (t, stem, files)).collect();
    others.sort();
    let used = |others: &[(std::time::SystemTime, String, Vec<PathBuf>)]| others.iter().flat_map(|(_, _, f)| f).map(|p| allocated(p)).sum::<u64>() + keep.files.iter().map(|p| allocated(p)).sum::<u64>();
    let mut total = used(&others);
    while total + needed > budget && !others.is_empty() {
        let (_, stem, files) = others.remove(0);
        tracing::info!("removing the shipped model {stem} to stay within the disk budget");
        for f in files {
            let _ = std::fs::remove_file(f);
        }
        let _ = std::fs::remove_file(dir.join(format!("{stem}.manifest.json")));
        let _ = std::fs::remove_file(dir.join(format!("{stem}.verified.json")));
        total = used(&others);
    }
    if total + needed > budget {
        return Err(format!("the disk budget ({:.1} MB) is too small: this worker's windows need {:.1} MB more", budget as f64 / 1e6, needed as f64 / 1e6));
    }
    Ok(())
}

/// A worker's copy of the head's files, each where the manifest places it in the model's
/// byte space.
struct LocalFiles {
    files: Vec<(Range<u64>, Arc<std::fs::File>)>,
}

impl LocalFiles {
    /// The file that holds the piece, and where in it the piece starts.
    fn locate(&self, piece: &Piece) -> Result<(Arc<std::fs::File>, u64), String> {
        let end = piece.offset.checked_add(piece.bytes).ok_or("a piece past the end of the byte space")?;
        self.files
            .iter()
            .find(|(r, _)| r.start <= piece.offset && end <= r.end)
            .map(|(r, f)| (f.clone(), piece.offset - r.start))
            .ok_or_else(|| format!("bytes {}..{end} of the head's manifest lie in none of its files", piece.offset))
    }
}

impl Manifest {
    /// The files must follow one another and hold their headers: a manifest that says
    /// otherwise is refused before any file is made from it.
    fn check_files(&self) -> Result<(), String> {
        if self.files.is_empty() || self.files.len() as u64 > engine::gguf::split::MAX_PARTS {
            return Err(format!("the head's manifest lists {} files", self.files.len()));
        }
        let mut end = 0;
        for f in &self.files {
            let start = f.header.offset;
            if start < end || f.header.bytes > f.file_bytes {
                return Err("the head's manifest places its files over one another".into());
            }
            end = start.checked_add(f.file_bytes).ok_or("the head's manifest lists a file past the end of the byte space")?;
        }
        Ok(())
    }
}

fn read_piece(files: &LocalFiles, piece: &Piece) -> std::io::Result<String> {
    let (file, start) = files.locate(piece).map_err(std::io::Error::other)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; (piece.bytes as usize).min(MAX_BLOB_BYTES)];
    let mut at = 0;
    while at < piece.bytes {
        let n = ((piece.bytes - at) as usize).min(buf.len());
        file.read_exact_at(&mut buf[..n], start + at)?;
        hasher.update(&buf[..n]);
        at += n as u64;
    }
    Ok(hex(&hasher.finalize()))
}

/// Logs progress every `LOG_EVERY`, with a bar when stderr is a terminal.
struct Reporter {
    last: Instant,
    started: Instant,
    terminal: bool,
}

impl Reporter {
    fn new() -> Reporter {
        let now = Instant::now();
        Reporter { last: now, started: now, terminal: std::io::IsTerminal::is_terminal(&std::io::stderr()) }
    }

    fn report(&mut self, progress: &Progress, force: bool) {
        if !force && self.last.elapsed() < LOG_EVERY {
            return;
        }
        self.last = Instant::now();
        let (verified, needed, fetched) = (progress.verified.load(Ordering::Relaxed), progress.needed.load(Ordering::Relaxed), progress.fetched.load(Ordering::Relaxed));
        let share = verified as f64 / needed.max(1) as f64;
        let rate = fetched as f64 / self.started.elapsed().as_secs_f64().max(1e-3) / 1e6;
        let bar = if self.terminal {
            let filled = ((share * BAR_WIDTH as f64) as usize).min(BAR_WIDTH);
            format!("[{}{}] ", "#".repeat(filled), ".".repeat(BAR_WIDTH - filled))
        } else {
            String::new()
        };
        tracing::info!("fetching the model from the head: {bar}{:.0}% ({:.1} of {:.1} MB), {rate:.1} MB/s", share * 100.0, verified as f64 / 1e6, needed as f64 / 1e6);
    }
}

async fn connect(source: &str, secret: &ClusterSecret) -> Result<ControlClient, String> {
    let mut attempt = 0;
    loop {
        match ControlClient::connect(source, secret, &LinkConfig::default()).await {
            Ok(c) => return Ok(c),
            Err(e @ (transport::Error::Auth { .. } | transport::Error::Secret(_))) => return Err(format!("the head at {source} refused: {e}")),
            Err(e) => {
                attempt += 1;
                if attempt >= LINK_ATTEMPTS {
                    return Err(format!("cannot reach the head at {source}: {e}"));
                }
                tokio::time::sleep(LINK_RETRY).await;
            }
        }
    }
}

async fn manifest_of(client: &ControlClient, request: &FetchRequest) -> Result<Manifest, String> {
    let mut logged = Instant::now() - LOG_EVERY;
    loop {
        match client.call(MANIFEST, &Value::Null).await {
            Ok(v) => {
                let m: Manifest = serde_json::from_value(v).map_err(|e| format!("the head sent no manifest: {e}"))?;
                if m.fingerprint != request.fingerprint {
                    return Err(format!("the head serves model {} but asked for {}", m.fingerprint, request.fingerprint));
                }
                return Ok(m);
            }
            Err(transport::Error::Control { status: 503, message, .. }) if message.contains(COMPUTING) => {
                if logged.elapsed() >= LOG_EVERY {
                    tracing::info!("waiting for the head: {message}");
                    logged = Instant::now();
                }
                tokio::time::sleep(LINK_RETRY).await;
            }
            Err(e) => return Err(format!("asking the head for its manifest: {e}")),
        }
    }
}

/// Why a piece could not be fetched: the link (worth connecting again) or this machine.
enum PieceError {
    Link(transport::Error),
    Local(String),
}

/// Fetches one piece into its file and checks it; `Ok(false)`: the bytes did not match.
async fn fetch_piece(client: &ControlClient, files: &LocalFiles, piece: &Piece, progress: &Progress) -> Result<bool, PieceError> {
    let (file, start) = files.locate(piece).map_err(PieceError::Local)?;
    let mut hasher = Sha256::new();
    let mut at = 0;
    while at < piece.bytes {
        let len = (piece.bytes - at).min(MAX_BLOB_BYTES as u64);
        let bytes = client.fetch(RANGE, &json!({"offset": piece.offset + at, "len": len})).await.map_err(PieceError::Link)?;
        if bytes.len() as u64 != len {
            return Ok(false);
        }
        hasher.update(&bytes);
        let (f, offset) = (file.clone(), start + at);
        tokio::task::spawn_blocking(move || f.write_all_at(&bytes, offset))
            .await
            .map_err(|e| PieceError::Local(e.to_string()))?
            .map_err(|e| PieceError::Local(format!("writing the model: {e}")))?;
        progress.fetched.fetch_add(len, Ordering::Relaxed);
        at += len;
    }
    Ok(hex(&hasher.finalize()) == piece.sha256)
}

async fn fetch(request: &FetchRequest, dir: &Path, budget: Option<u64>, secret: &ClusterSecret, progress: &Progress) -> Result<Arc<ModelFile>, String> {
    let windows: Vec<Range<usize>> = request.windows.iter().map(|&(a, b)| a..b).collect();
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create --model-dir {}: {e}", dir.display()))?;
    let mut client = connect(&request.source, secret).await?;
    let manifest = manifest_of(&client, request).await?;
    manifest.check_files()?;
    let paths = paths(dir, &manifest.fingerprint, manifest.files.len());
    let mut files = LocalFiles { files: Vec::new() };
    for (path, listed) in paths.files.iter().zip(&manifest.files) {
        let opened = crate::process::open_in_dir(path, crate::process::Open::ReadWrite).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        // A sparse file the size of the head's: tensors keep their offsets, and the bytes
        // this worker never fetches take no disk.
        if opened.metadata().map_err(|e| e.to_string())?.len() != listed.file_bytes {
            opened.set_len(listed.file_bytes).map_err(|e| format!("cannot size {}: {e}", path.display()))?;
        }
        files.files.push((listed.header.offset..listed.header.offset + listed.file_bytes, Arc::new(opened)));
    }
    let files = Arc::new(files);
    crate::process::write_atomically(&paths.manifest, &serde_json::to_vec(&manifest).unwrap_or_default()).map_err(|e| format!("cannot write {}: {e}", paths.manifest.display()))?;
    let mut verified: BTreeSet<String> = std::fs::read(&paths.record).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
    let by_name = manifest.by_name();
    let headers = manifest.headers();
    let listed = |name: &str| -> Option<Piece> {
        if let Some((_, piece)) = headers.iter().find(|(n, _)| n == name) {
            return Some(piece.clone());
        }
        by_name.get(name).map(|t| t.piece.clone())
    };
    // What an earlier fetch verified is checked again: a crash mid-write or a disk that
    // changed a byte must not reach a stage.
    let recorded: Vec<String> = verified.iter().cloned().collect();
    for name in recorded {
        let good = match listed(&name) {
            Some(piece) => {
                let f = files.clone();
                tokio::task::spawn_blocking(move || read_piece(&f, &piece).map(|d| d == piece.sha256)).await.map_err(|e| e.to_string())?.unwrap_or(false)
            }
            None => false,
        };
        if !good {
            tracing::warn!(piece = %name, "the local copy of a piece does not match the head's manifest (changed on disk?): fetching it again");
            verified.remove(&name);
        }
    }
    let record = |verified: &BTreeSet<String>| crate::process::write_atomically(&paths.record, &serde_json::to_vec(verified).unwrap_or_default());

    let mut reporter = Reporter::new();
    let mut last_record = Instant::now();
    // The headers first: they say where the windows' tensors are.
    let mut model: Option<Arc<ModelFile>> = None;
    let mut pieces = headers.clone();
    let mut i = 0;
    while i < pieces.len() {
        let (name, piece) = pieces[i].clone();
        if !verified.contains(&name) {
            let mut attempts = 0;
            let mut link_failures = 0;
            loop {
                match fetch_piece(&client, &files, &piece, progress).await {
                    Ok(true) => break,
                    Ok(false) => {
                        attempts += 1;
                        progress.refused.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(piece = %name, attempt = attempts, "bytes from the head do not match its manifest: refused, fetching them again");
                        if attempts >= PIECE_ATTEMPTS {
                            return Err(format!("piece {name} arrived wrong {PIECE_ATTEMPTS} times"));
                        }
                    }
                    Err(PieceError::Local(e)) => return Err(e),
                    Err(PieceError::Link(e)) => {
                        link_failures += 1;
                        if link_failures >= LINK_ATTEMPTS {
                            return Err(format!("fetching {name}: {e}"));
                        }
                        tracing::warn!("fetching {name}: {e}; connecting again");
                        tokio::time::sleep(LINK_RETRY).await;
                        client = connect(&request.source, secret).await?;
                    }
                }
            }
            verified.insert(name.clone());
            if last_record.elapsed() >= RECORD_EVERY {
                let _ = record(&verified);
                last_record = Instant::now();
            }
        }
        progress.verified.fetch_add(piece.bytes, Ordering::Relaxed);
        if model.is_none() && i + 1 == headers.len() {
            // The headers are here: open the model and list what the windows need.
            let opened = ModelFile::open_as(&paths.files[0], manifest.fingerprint.clone()).map_err(|e| format!("the fetched headers do not open: {e}"))?;
            let all = manifest.pieces_for(&opened, &windows)?;
            let needed: u64 = all.iter().map(|(_, p)| p.bytes).sum();
            progress.needed.store(needed, Ordering::Relaxed);
            let missing: u64 = all.iter().filter(|(n, _)| !verified.contains(n)).map(|(_, p)| p.bytes).sum();
            if let Some(budget) = budget {
                make_room(dir, &paths, missing, budget)?;
            }
            tracing::info!(windows = ?request.windows, "fetching the model from the head at {}: {:.1} MB for these windows, {:.1} MB of it already here", request.source, needed as f64 / 1e6, (needed - missing) as f64 / 1e6);
            pieces = all;
            model = Some(Arc::new(opened));
        }
        reporter.report(progress, false);
        i += 1;
    }
    // Written back before the windows are used: a device short of memory releases its
    // windows after each use, and the kernel cannot drop pages still dirty from the fetch
    // (they linger until writeback, tens of seconds), so the release would free nothing.
    let f = files.clone();
    tokio::task::spawn_blocking(move || f.files.iter().try_for_each(|(_, f)| f.sync_data())).await.map_err(|e| e.to_string())?.map_err(|e| format!("cannot write the model into {}: {e}", dir.display()))?;
    record(&verified).map_err(|e| format!("cannot write {}: {e}", paths.record.display()))?;
    reporter.report(progress, true);
    // The files' last use decides which shipped model a tight disk budget removes first.
    for (_, f) in &files.files {
        let _ = f.set_modified(std::time::SystemTime::now());
    }
    model.ok_or_else(|| "no header".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn paths_are_named_after_the_fingerprint() {
        let p = paths(Path::new("/m"), "0123456789abcdef0123", 1);
        assert_eq!(p.files, [Path::new("/m/shipped-0123456789abcdef.gguf")]);
        assert_eq!(p.record, Path::new("/m/shipped-0123456789abcdef.verified.json"));
        assert_eq!(paths(Path::new("/m"), "../../etc/passwd", 1).files, [Path::new("/m/shipped-ecad.gguf")], "only hex digits");
        assert_eq!(paths(Path::new("/m"), "é", 1).files, [Path::new("/m/shipped-.gguf")]);
        // A split set's parts, named so the engine finds them from the first.
        let split = paths(Path::new("/m"), "0123456789abcdef0123", 2);
        assert_eq!(split.files, [Path::new("/m/shipped-0123456789abcdef-00001-of-00002.gguf"), Path::new("/m/shipped-0123456789abcdef-00002-of-00002.gguf")]);
        assert_eq!(split.files.iter().map(|f| shipped_stem(f.file_name().unwrap().to_str().unwrap())).collect::<Vec<_>>(), [Some("shipped-0123456789abcdef"); 2]);
        assert_eq!(shipped_stem("shipped-0123456789abcdef.manifest.json"), None);
        assert_eq!(shipped_stem("model.gguf"), None, "only shipped models are removed for room");
    }

    #[test]
    fn a_link_planted_in_the_model_dir_is_not_written_through() {
        let dir = std::env::temp_dir().join(format!("hearth-link-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let outside = dir.with_extension("outside");
        std::fs::write(&outside, b"precious").unwrap();
        let p = paths(&dir, "0123456789abcdef", 1);
        std::os::unix::fs::symlink(&outside, &p.files[0]).unwrap();
        std::os::unix::fs::symlink(&outside, &p.manifest).unwrap();
        let e = crate::process::open_in_dir(&p.files[0], crate::process::Open::ReadWrite).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        // An atomic write replaces the link itself.
        crate::process::write_atomically(&p.manifest, b"{}").unwrap();
        assert!(!std::fs::symlink_metadata(&p.manifest).unwrap().file_type().is_symlink());
        // A link at the name of the file aside is removed, not written through.
        std::os::unix::fs::symlink(&outside, p.record.with_extension(format!("tmp.{}", std::process::id()))).unwrap();
        crate::process::write_atomically(&p.record, b"[]").unwrap();
        assert_eq!(std::fs::read(&outside).unwrap(), b"precious");
        // Nor a FIFO opened (it would wait for a reader) or written.
        let fifo = dir.join("shipped-fifo.gguf");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = crate::process::open_in_dir(&fifo, crate::process::Open::ReadWrite).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::remove_file(&outside).unwrap();
    }

    const SECRET: &str = "shipping test secret";

    /// A head's ring listener for `file` whose range answers flip one byte, once, in the
    /// first answer that covers `tamper` (a byte offset); counts the bytes it sent.
    async fn head(file: Arc<ModelFile>, tamper: u64, sent: Arc<AtomicUsize>) -> transport::LinkServer {
        let store = ManifestStore::new(file.clone());
        let control = move |method: String, _: Value| {
            let store = store.clone();
            async move {
                assert_eq!(method, MANIFEST);
                serve_manifest(&store)
            }
        };
        let tampered = Arc::new(AtomicBool::new(false));
        let blobs = move |method: String, body: Value| {
            let (file, sent, tampered) = (file.clone(), sent.clone(), tampered.clone());
            async move {
                assert_eq!(method, RANGE);
                let (offset, len) = (body["offset"].as_u64().unwrap(), body["len"].as_u64().unwrap());
                let bytes = serve_range(file, body).await?;
                sent.fetch_add(bytes.len(), Ordering::SeqCst);
                if (offset..offset + len).contains(&tamper) && !tampered.swap(true, Ordering::SeqCst) {
                    let mut changed = bytes.to_vec();
                    changed[(tamper - offset) as usize] ^= 0x10;
                    return Ok(Bytes::from(changed));
                }
                Ok(bytes)
            }
        };
        let secret = ClusterSecret::new(SECRET).unwrap();
        transport::LinkServer::bind_with_blobs("127.0.0.1:0".parse().unwrap(), secret, LinkConfig::default(), Some(Arc::new(control)), Some(Arc::new(blobs))).await.unwrap()
    }

    async fn until_done(shipper: &Shipper, request: &FetchRequest) -> (FetchStatus, Option<Arc<ModelFile>>) {
        let mut last = FetchStatus::default();
        for _ in 0..1200 {
            let (status, file) = shipper.fetch(request.clone());
            if status.ready || status.error.is_some() {
                return (status, file);
            }
            last = status;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the fetch of {request:?} did not finish within a minute: {last:?}");
    }

    /// A model file truncated under the head (a new version copied over it): a worker's
    /// range request, even past the new end, is refused with the reason, and the head lives
    /// (without the checks, the read past the end would be SIGBUS).
    #[tokio::test]
    async fn a_model_file_that_shrank_is_not_shipped() {
        let model = std::env::temp_dir().join(format!("hearth-shrunk-model-{}.gguf", std::process::id()));
        engine::random_model::RandomModel::new("llama", 2, 256, 512, 4, 2).write(&crate::models::vocabulary_fixture(), &model).unwrap();
        let file = Arc::new(ModelFile::open(&model).unwrap());
        let len = file.gguf.bytes().len() as u64;
        let tail = serde_json::json!({"offset": len - 4096, "len": 4096});
        assert!(serve_range(file.clone(), tail.clone()).await.is_ok());
        std::fs::OpenOptions::new().write(true).open(&model).unwrap().set_len(len / 2).unwrap();
        let refused = serve_range(file.clone(), tail).await.unwrap_err();
        assert!(format!("{refused:?}").contains("changed size"), "{refused:?}");
        std::fs::remove_file(&model).unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_worker_fetches_only_its_windows_refuses_wrong_bytes_and_resumes() {
        let _ = tracing_subscriber::fmt().with_test_writer().try_init();
        // A small random model with the checked-in vocabulary: nothing to download.
        let model = std::env::temp_dir().join(format!("hearth-shipping-model-{}.gguf", std::process::id()));
        engine::random_model::RandomModel::new("llama", 6, 256, 512, 4, 2).write(&crate::models::vocabulary_fixture(), &model).unwrap();
        fetches_only_its_windows(&model, "one").await;
        // The same model as a split set of three parts: the parts' headers cross, each
        // tensor lands in its part, and the copy opens as the same split set.
        let file = ModelFile::open(&model).unwrap();
        let prefix = model.with_extension("").to_string_lossy().into_owned() + "-split";
        let part_bytes = file.gguf.bytes().len() as u64 / 3;
        let parts = engine::gguf::split::write_split(&file.gguf, &prefix, part_bytes).unwrap();
        assert!(parts.len() >= 3, "{parts:?}");
        fetches_only_its_windows(&parts[0], "split").await;
        for p in parts.iter().chain([&model]) {
            let _ = std::fs::remove_file(p);
        }
    }

    async fn fetches_only_its_windows(model: &Path, tag: &str) {
        let file = Arc::new(ModelFile::open(model).unwrap());
        let meta = file.gguf.meta();
        let data = file.gguf.data_offset();
        let headers: u64 = file.gguf.parts().iter().map(|p| p.header_len()).sum();
        let windows = vec![(1usize, 3usize)];
        let wanted = engine::model_file::window_tensors(meta, &[1..3]);
        let target = meta.tensor("blk.1.attn_q.weight").unwrap().clone();
        let sent = Arc::new(AtomicUsize::new(0));
        let server = head(file.clone(), data + target.offset + target.n_bytes / 2, sent.clone()).await;
        let dir = std::env::temp_dir().join(format!("hearth-shipping-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let secret = ClusterSecret::new(SECRET).unwrap();
        let request = FetchRequest { fingerprint: file.fingerprint(), source: server.local_addr().to_string(), windows };

        // Only the headers and the windows' tensors cross; the tampered piece is refused
        // and fetched again.
        let (status, shipped) = until_done(&Shipper::new(dir.clone(), None, secret.clone()), &request).await;
        assert!(status.ready, "{status:?}");
        let needed = headers + wanted.iter().map(|t| t.n_bytes).sum::<u64>();
        assert_eq!(status.needed_bytes, needed);
        assert_eq!(status.refused_pieces, 1);
        assert_eq!(status.fetched_bytes, needed + target.n_bytes, "the tampered tensor is fetched twice, nothing else");
        assert_eq!(sent.load(Ordering::SeqCst) as u64, status.fetched_bytes);
        let shipped = shipped.expect("the fetched file");
        assert_eq!(shipped.fingerprint(), file.fingerprint(), "the sparse copy carries the head's fingerprint");
        assert_eq!(shipped.gguf.parts().len(), file.gguf.parts().len(), "the copy has the head's files");
        for t in &wanted {
            assert!(shipped.gguf.tensor_bytes(t) == file.gguf.tensor_bytes(t), "tensor {} differs", t.name);
        }
        let outside = meta.tensor("blk.5.attn_q.weight").unwrap();
        assert!(shipped.gguf.tensor_bytes(outside).iter().all(|&b| b == 0), "a tensor outside the windows was fetched");
        let on_disk: u64 = shipped.gguf.parts().iter().map(|p| allocated(p.path())).sum();
        assert!(on_disk < needed + 8 * 4096 * (wanted.len() + file.gguf.parts().len()) as u64, "the files take {on_disk} bytes of disk for {needed} fetched");

        // A restarted worker checks what it has and fetches nothing.
        let before = sent.load(Ordering::SeqCst);
        let (status, _) = until_done(&Shipper::new(dir.clone(), None, secret.clone()), &request).await;
        assert!(status.ready && status.fetched_bytes == 0, "{status:?}");
        assert_eq!(sent.load(Ordering::SeqCst), before);

        // A byte changed on disk: that tensor, and only it, is fetched again.
        let changed = meta.tensor("blk.2.ffn_down.weight").unwrap();
        let at = (data + changed.offset + 7) as usize;
        let (part, within) = shipped.gguf.file_ranges(at..at + 1).next().expect("in a file");
        let local = std::fs::OpenOptions::new().read(true).write(true).open(part.path()).unwrap();
        let mut byte = [0u8];
        local.read_exact_at(&mut byte, within.start).unwrap();
        local.write_all_at(&[byte[0] ^ 1], within.start).unwrap();
        let (status, _) = until_done(&Shipper::new(dir.clone(), None, secret.clone()), &request).await;
        assert!(status.ready, "{status:?}");
        assert_eq!(status.fetched_bytes, changed.n_bytes);
        assert!(shipped.gguf.tensor_bytes(changed) == file.gguf.tensor_bytes(changed));

        // Other windows: the new tensors only.
        let more = FetchRequest { windows: vec![(1, 4)], ..request.clone() };
        let (status, _) = until_done(&Shipper::new(dir.clone(), None, secret.clone()), &more).await;
        let layer3: u64 = engine::model_file::window_tensors(meta, &[3..4]).iter().map(|t| t.n_bytes).sum();
        assert_eq!(status.fetched_bytes, layer3, "{status:?}");

        // A disk budget too small for the windows is an error, not a full disk.
        let tight = dir.join("tight");
        let (status, _) = until_done(&Shipper::new(tight, Some(needed / 2), secret), &request).await;
        assert!(status.error.as_deref().is_some_and(|e| e.contains("disk budget")), "{status:?}");

        // Another secret: refused at the handshake, not a byte sent.
        let before = sent.load(Ordering::SeqCst);
        let stranger = Shipper::new(dir.join("stranger"), None, ClusterSecret::new("another secret").unwrap());
        let (status, _) = until_done(&stranger, &request).await;
        assert!(status.error.is_some(), "{status:?}");
        assert_eq!(sent.load(Ordering::SeqCst), before, "bytes went to a peer without the secret");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
