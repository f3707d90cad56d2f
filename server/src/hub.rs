//! Models pulled by name from the Hugging Face hub (`hearth pull owner/name:Q4_K_M`,
//! `--model hf:owner/name:Q4_K_M`), as llama.cpp's `-hf` picks them, into the hub's own
//! cache layout (`models--owner--name/{refs,blobs,snapshots}`), so a file another tool
//! downloaded is found and not fetched twice, and one hearth pulled is found by them.
//!
//! The protocol is the hub's documented HTTP one, on any mirror (`HF_ENDPOINT`): the repo's
//! listing with each file's size and SHA-256 (`/api/models/{repo}/revision/main?blobs=true`),
//! then each file from `/{repo}/resolve/{commit}/{path}` (which redirects to storage), so
//! every part of a split model comes from one commit. Downloads resume where they stopped
//! (an HTTP range from the end of `blobs/<sha>.incomplete`), across dropped connections and
//! killed processes, and a file is kept only when it is what the hub lists: an LFS file
//! (every GGUF of any size) by its SHA-256, a small file kept in git by its git blob id.
//! The listing is read up to `LISTING_LIMIT` bytes, and a pull that would not fit on the
//! cache's disk is refused before its first byte.
//!
//! A leaf like `models`: the CLI resolves `--model` with it. Only the head pulls; workers
//! fetch their windows from the head.

use std::io::{IsTerminal, Read, Seek, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::Deserialize;
use sha1::Sha1;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::models::is_model;

/// The prefix that makes `--model` a hub reference instead of a path.
pub const PREFIX: &str = "hf:";
/// Where the hub is when `HF_ENDPOINT` does not say.
const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
/// Quantizations tried, in order, when the reference names none (llama.cpp's `-hf` default).
const DEFAULT_TAGS: [&str; 2] = ["Q4_K_M", "Q8_0"];
/// Tries per file: a dropped connection resumes where it stopped.
const ATTEMPTS: u32 = 6;
/// Wait before the first retry, doubled each time (at most ~1 minute in all).
const FIRST_RETRY: Duration = Duration::from_secs(1);
/// A log line with the progress this often when stderr is not a terminal.
const LOG_EVERY: Duration = Duration::from_secs(10);
/// The most bytes of a repo's listing read: an entry is ~200 bytes, so this holds ~80,000
/// files, far more than any model repo has; a listing past it is refused rather than held
/// in memory whole (a hostile mirror can send gigabytes).
const LISTING_LIMIT: usize = 16 << 20;
/// Room left on the cache's disk after a pull: a disk filled to the last byte breaks
/// everything else writing to it (logs, the prompt cache, the system).
const DISK_MARGIN: u64 = 1 << 30;
/// The terminal's progress line is redrawn at most this often.
const DRAW_EVERY: Duration = Duration::from_millis(200);

/// Where and as whom to reach the hub, from the environment as the hub's own tools read it.
#[derive(Debug, Clone)]
pub struct Hub {
    pub endpoint: String,
    pub token: Option<String>,
    /// The hub cache: the folder holding `models--owner--name`.
    pub cache: PathBuf,
}

impl Hub {
    /// `HF_ENDPOINT` (a mirror), `HF_TOKEN` (else the token file `huggingface-cli login`
    /// writes: `HF_TOKEN_PATH` or `$HF_HOME/token`), and the cache: `HF_HUB_CACHE`, else
    /// `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
    /// `~/.cache/huggingface/hub`.
    pub fn from_env() -> Hub {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
        let home = var("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
        let hf_home = var("HF_HOME").map(PathBuf::from).unwrap_or_else(|| var("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or_else(|| home.join(".cache")).join("huggingface"));
        let cache = var("HF_HUB_CACHE").or_else(|| var("HUGGINGFACE_HUB_CACHE")).map(PathBuf::from).unwrap_or_else(|| hf_home.join("hub"));
        let token_file = var("HF_TOKEN_PATH").map(PathBuf::from).unwrap_or_else(|| hf_home.join("token"));
        let token = std::env::var("HF_TOKEN").ok().or_else(|| std::fs::read_to_string(token_file).ok()).map(|t| t.trim().to_string()).filter(|t| !t.is_empty());
        let endpoint = std::env::var("HF_ENDPOINT").ok().filter(|e| !e.is_empty()).unwrap_or_else(|| DEFAULT_ENDPOINT.into());
        Hub { endpoint: endpoint.trim_end_matches('/').to_string(), token, cache }
    }

    /// `models--owner--name` in the cache.
    fn repo_dir(&self, repo: &str) -> PathBuf {
        self.cache.join(format!("models--{}", repo.replace('/', "--")))
    }
}

/// `owner/name[:TAG]`: TAG is a quantization (`Q4_K_M`, matched in file names as
/// llama.cpp matches it) or a file name ending in `.gguf`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelRef {
    pub repo: String,
    pub tag: Option<String>,
}

impl std::str::FromStr for ModelRef {
    type Err = Error;

    fn from_str(s: &str) -> Result<ModelRef> {
        let s = s.strip_prefix(PREFIX).unwrap_or(s);
        let (repo, tag) = match s.split_once(':') {
            Some((r, t)) => (r, Some(t.to_string()).filter(|t| !t.is_empty())),
            None => (s, None),
        };
        let bad = || Error::Fetch(format!("{s:?} is not a hub model: expected owner/name or owner/name:QUANT (e.g. bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M)"));
        let (owner, name) = repo.split_once('/').ok_or_else(bad)?;
        let part_ok = |p: &str| !p.is_empty() && p != "." && p != ".." && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
        if !part_ok(owner) || !part_ok(name) {
            return Err(bad());
        }
        if let Some(t) = &tag {
            if !t.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
                return Err(bad());
            }
        }
        Ok(ModelRef { repo: repo.to_string(), tag })
    }
}

impl std::fmt::Display for ModelRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.tag {
            Some(t) => write!(f, "{}:{t}", self.repo),
            None => f.write_str(&self.repo),
        }
    }
}

/// A file of the repo as the hub lists it.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteFile {
    pub path: String,
    pub size: u64,
    /// The hub's SHA-256 of an LFS file (every GGUF is one): checked after the download,
    /// and the name of its blob in the cache.
    pub sha256: Option<String>,
    /// The blob's name in the cache: the SHA-256, or the git blob id of a small file.
    pub blob: String,
}

#[derive(Deserialize)]
struct Listing {
    sha: String,
    #[serde(default)]
    siblings: Vec<Sibling>,
}

#[derive(Deserialize)]
struct Sibling {
    rfilename: String,
    #[serde(default)]
    size: Option<u64>,
    #[serde(default, rename = "blobId")]
    blob_id: Option<String>,
    #[serde(default)]
    lfs: Option<Lfs>,
}

#[derive(Deserialize)]
struct Lfs {
    sha256: String,
    size: u64,
}

/// llama.cpp's split naming, as the engine reads it to find a set's parts.
pub use engine::gguf::split::split_part;


/// Whether `path` carries the quantization `tag`: `TAG` followed by `.` or `-`, in any case
/// (`Q4_K_M` matches `model-Q4_K_M.gguf` and `Q4_K_M/model-Q4_K_M-00001-of-00002.gguf`, not
/// `model-Q4_K_M_L.gguf`).
fn has_tag(path: &str, tag: &str) -> bool {
    let (p, t) = (path.to_ascii_lowercase(), tag.to_ascii_lowercase());
    p.match_indices(&t).any(|(i, _)| matches!(p.as_bytes().get(i + t.len()), Some(b'.' | b'-')))
}

/// The files of the model `tag` picks among `files` (every part of a split model, in
/// order): an exact file name; else the first model file with the quantization (the first
/// part of a split one); with no tag, `Q4_K_M`, else `Q8_0`, else the first model file.
/// The second value says which rule chose, for the user.
pub fn choose(files: &[RemoteFile], tag: Option<&str>) -> Result<(Vec<RemoteFile>, String)> {
    let models: Vec<&RemoteFile> = files.iter().filter(|f| is_model(&f.path)).collect();
    let first_part = |f: &RemoteFile| split_part(&f.path).is_none_or(|(_, no, _)| no == 1);
    let (chosen, why) = match tag {
        Some(t) if t.to_ascii_lowercase().ends_with(".gguf") => {
            let f = models.iter().find(|f| f.path == t || f.path.rsplit('/').next() == Some(t)).ok_or_else(|| not_found(&models, &format!("no file {t}")))?;
            (*f, format!("the file {t}"))
        }
        Some(t) => {
            let f = models.iter().filter(|f| first_part(f)).find(|f| has_tag(&f.path, t)).ok_or_else(|| not_found(&models, &format!("no {t} file")))?;
            (*f, format!("the {t} quantization"))
        }
        None => match DEFAULT_TAGS.iter().find_map(|t| models.iter().filter(|f| first_part(f)).find(|f| has_tag(&f.path, t)).map(|f| (f, t))) {
            Some((f, t)) => (*f, format!("{t} (no quantization named; add :QUANT to choose)")),
            None => {
                let f = models.iter().find(|f| first_part(f)).ok_or_else(|| not_found(&models, "no GGUF model file"))?;
                (*f, "the repo's first GGUF (no quantization named, and no Q4_K_M or Q8_0; add :QUANT to choose)".into())
            }
        },
    };
    let Some((prefix, _, count)) = split_part(&chosen.path) else { return Ok((vec![chosen.clone()], why)) };
    let mut parts = Vec::with_capacity(count as usize);
    for no in 1..=count {
        let name = format!("{prefix}-{no:05}-of-{count:05}.gguf");
        let part = files.iter().find(|f| f.path == name).ok_or_else(|| Error::Fetch(format!("the split model {} lacks its part {name}", chosen.path)))?;
        parts.push(part.clone());
    }
    Ok((parts, why))
}

fn not_found(models: &[&RemoteFile], what: &str) -> Error {
    let mut names: Vec<&str> = models.iter().filter(|f| split_part(&f.path).is_none_or(|(_, no, _)| no == 1)).map(|f| f.path.as_str()).collect();
    names.truncate(40);
    if names.is_empty() {
        Error::Fetch(format!("{what}: the repo has no GGUF model files"))
    } else {
        Error::Fetch(format!("{what} in the repo; its GGUF models: {}", names.join(", ")))
    }
}

/// A repo path safe to join under the cache (no `..`, no absolute path, no backslash).
fn safe_path(path: &str) -> bool {
    !path.is_empty() && !path.starts_with('/') && !path.contains('\\') && path.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
}

fn hex_name(s: &str) -> bool {
    (40..=64).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// What a pull did, for the CLI and the log.
#[derive(Debug, Clone)]
pub struct Pulled {
    /// The model's first (or only) file, in the cache's snapshot folder.
    pub path: PathBuf,
    pub files: Vec<RemoteFile>,
    pub commit: String,
    /// Bytes this pull downloaded (0: every file was already here).
    pub downloaded: u64,
    pub why: String,
}

/// Pulls `model`: lists the repo, picks its files, downloads what the cache lacks. Offline
/// (the hub unreachable), a model already in the cache is used as it is.
pub fn pull(hub: &Hub, model: &ModelRef) -> Result<Pulled> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| Error::Fetch(format!("cannot start a runtime: {e}")))?;
    rt.block_on(pull_async(hub, model))
}

fn client(hub: &Hub) -> Result<reqwest::Client> {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(t) = &hub.token {
        let mut v = reqwest::header::HeaderValue::from_str(&format!("Bearer {t}")).map_err(|_| Error::Fetch("HF_TOKEN has characters a header cannot carry".into()))?;
        v.set_sensitive(true);
        headers.insert(reqwest::header::AUTHORIZATION, v);
    }
    // reqwest drops the Authorization header on a redirect to another host (the storage
    // the hub sends downloads to must not see the token).
    reqwest::Client::builder()
        .user_agent(concat!("hearth/", env!("CARGO_PKG_VERSION")))
        .default_headers(headers)
        .connect_timeout(Duration::from_secs(30))
        .read_timeout(Duration::from_secs(60))
        .build()
        .map_err(|e| Error::Fetch(format!("cannot make an HTTP client: {e}")))
}

async fn pull_async(hub: &Hub, model: &ModelRef) -> Result<Pulled> {
    let client = client(hub)?;
    let url = format!("{}/api/models/{}/revision/main?blobs=true", hub.endpoint, model.repo);
    let listing = match client.get(&url).send().await {
        Ok(r) if r.status().is_success() => {
            let body = read_bounded(r, LISTING_LIMIT).await.map_err(|e| Error::Fetch(format!("{url}: {e}")))?;
            serde_json::from_slice::<Listing>(&body).map_err(|e| Error::Fetch(format!("{url}: not the hub's listing: {e}")))?
        }
        Ok(r) => {
            let status = r.status();
            let what = match status.as_u16() {
                401 | 403 => format!("{} is gated or private: accept its terms on the hub and set HF_TOKEN", model.repo),
                404 => format!("no model {} on {}", model.repo, hub.endpoint),
                _ => format!("{} answered {status} for {}", hub.endpoint, model.repo),
            };
            return Err(Error::Fetch(what));
        }
        Err(e) => {
            return match cached(hub, model) {
                Some(p) => {
                    tracing::warn!("cannot reach {} ({e}): using {} from the cache", hub.endpoint, p.path.display());
                    Ok(p)
                }
                None => Err(Error::Fetch(format!("cannot reach {} for {model}: {e}", hub.endpoint))),
            };
        }
    };
    if !hex_name(&listing.sha) {
        return Err(Error::Fetch(format!("{}: the listing's commit {:?} is not a commit id", hub.endpoint, listing.sha)));
    }
    let files: Vec<RemoteFile> = listing
        .siblings
        .into_iter()
        .filter(|s| safe_path(&s.rfilename))
        .filter_map(|s| {
            let (size, sha256) = match s.lfs {
                Some(l) => (l.size, Some(l.sha256.to_ascii_lowercase())),
                None => (s.size?, None),
            };
            let blob = sha256.clone().or(s.blob_id)?.to_ascii_lowercase();
            hex_name(&blob).then_some(RemoteFile { path: s.rfilename, size, sha256, blob })
        })
        .collect();
    let (chosen, why) = choose(&files, model.tag.as_deref())?;
    let dir = hub.repo_dir(&model.repo);
    let snapshot = dir.join("snapshots").join(&listing.sha);
    let total: u64 = chosen.iter().map(|f| f.size).sum();
    fits_on_disk(&dir, &chosen, &model.to_string())?;
    let mut progress = Progress::new(model.to_string(), total);
    let mut downloaded = 0;
    for f in &chosen {
        downloaded += fetch_blob(&client, hub, &model.repo, &listing.sha, f, &dir, &mut progress).await?;
        link(&dir, &snapshot, f)?;
    }
    progress.finish();
    std::fs::create_dir_all(dir.join("refs")).map_err(|e| io("create", &dir, e))?;
    crate::process::write_atomically(&dir.join("refs").join("main"), listing.sha.as_bytes()).map_err(|e| io("write", &dir.join("refs/main"), e))?;
    Ok(Pulled { path: snapshot.join(&chosen[0].path), files: chosen, commit: listing.sha, downloaded, why })
}

fn io(what: &str, path: &Path, e: std::io::Error) -> Error {
    Error::Fetch(format!("cannot {what} {}: {e}", path.display()))
}

/// The model as the cache holds it from an earlier pull (`refs/main`'s snapshot), if
/// every part is there.
pub fn cached(hub: &Hub, model: &ModelRef) -> Option<Pulled> {
    let dir = hub.repo_dir(&model.repo);
    let commit = std::fs::read_to_string(dir.join("refs").join("main")).ok()?.trim().to_string();
    if !hex_name(&commit) {
        return None;
    }
    let snapshot = dir.join("snapshots").join(&commit);
    let mut files = Vec::new();
    list_files(&snapshot, &snapshot, &mut files);
    let (chosen, why) = choose(&files, model.tag.as_deref()).ok()?;
    Some(Pulled { path: snapshot.join(&chosen[0].path), files: chosen, commit, downloaded: 0, why })
}

/// Every model the cache holds (each repo's `refs/main` snapshot): its `hf:` name, the
/// model file's path in the repo and the bytes of all its parts (a split set once, by its
/// first part).
pub fn local_models(hub: &Hub) -> Vec<(String, u64)> {
    let Ok(entries) = std::fs::read_dir(&hub.cache) else { return Vec::new() };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(repo) = name.strip_prefix("models--").map(|r| r.replacen("--", "/", 1)) else { continue };
        let Some(commit) = std::fs::read_to_string(e.path().join("refs").join("main")).ok().map(|c| c.trim().to_string()).filter(|c| hex_name(c)) else { continue };
        let snapshot = e.path().join("snapshots").join(&commit);
        let mut files = Vec::new();
        list_files(&snapshot, &snapshot, &mut files);
        for (path, bytes) in crate::models::model_sets(files.iter().map(|f| (f.path.as_str(), f.size))) {
            out.push((format!("hf:{repo}:{path}"), bytes));
        }
    }
    out.sort();
    out
}

/// Files under `dir` as repo paths (sizes as they are; no hashes).
fn list_files(root: &Path, dir: &Path, out: &mut Vec<RemoteFile>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            list_files(root, &p, out);
        } else if let (Ok(meta), Ok(rel)) = (std::fs::metadata(&p), p.strip_prefix(root)) {
            out.push(RemoteFile { path: rel.to_string_lossy().into_owned(), size: meta.len(), sha256: None, blob: String::new() });
        }
    }
}

/// `snapshots/<commit>/<path>` -> `../../blobs/<blob>` (relative, as the hub's tools link).
fn link(dir: &Path, snapshot: &Path, f: &RemoteFile) -> Result<()> {
    let at = snapshot.join(&f.path);
    let depth = f.path.split('/').count() + 1;
    let target = PathBuf::from("../".repeat(depth)).join("blobs").join(&f.blob);
    if let Some(parent) = at.parent() {
        std::fs::create_dir_all(parent).map_err(|e| io("create", parent, e))?;
    }
    if std::fs::read_link(&at).is_ok_and(|t| t == target) {
        return Ok(());
    }
    let _ = std::fs::remove_file(&at);
    debug_assert!(dir.join("blobs").join(&f.blob).exists());
    std::os::unix::fs::symlink(&target, &at).map_err(|e| io("link", &at, e))
}

/// Downloads `f` into `blobs/`, resuming a partial download; returns the bytes fetched.
async fn fetch_blob(client: &reqwest::Client, hub: &Hub, repo: &str, commit: &str, f: &RemoteFile, dir: &Path, progress: &mut Progress) -> Result<u64> {
    let blobs = dir.join("blobs");
    let blob = blobs.join(&f.blob);
    if std::fs::metadata(&blob).is_ok_and(|m| m.len() == f.size) {
        progress.skip(f.size);
        return Ok(0);
    }
    std::fs::create_dir_all(&blobs).map_err(|e| io("create", &blobs, e))?;
    // One puller per blob: a second hearth pulling the same model waits for the first.
    let _lock = BlobLock::take(&blobs.join(format!("{}.lock", f.blob))).await?;
    if std::fs::metadata(&blob).is_ok_and(|m| m.len() == f.size) {
        progress.skip(f.size);
        return Ok(0);
    }
    let part_path = blobs.join(format!("{}.incomplete", f.blob));
    progress.start_file();
    let url = format!("{}/{repo}/resolve/{commit}/{}", hub.endpoint, f.path);
    let mut fetched = 0u64;
    let mut wait = FIRST_RETRY;
    let mut last_error = String::new();
    for attempt in 1..=ATTEMPTS {
        if attempt > 1 {
            tracing::warn!(file = %f.path, attempt, "download interrupted ({last_error}): resuming in {:?}", wait);
            tokio::time::sleep(wait).await;
            wait *= 2;
        }
        match resume(client, &url, f, &part_path, progress).await {
            Ok(n) => {
                fetched += n;
                break;
            }
            Err(Resume::Retry(e, n)) => {
                fetched += n;
                last_error = e;
            }
            Err(Resume::Fail(e)) => return Err(e),
        }
        if attempt == ATTEMPTS {
            return Err(Error::Fetch(format!("{}: {last_error} ({ATTEMPTS} tries); run the pull again to resume", f.path)));
        }
    }
    // The whole file is here: it is kept only if it is what the hub lists — an LFS file by
    // its SHA-256, a file kept in git by its blob id (SHA-1 of a "blob <size>" header and
    // the bytes, what git names it by).
    let check = part_path.clone();
    let lfs = f.sha256.is_some();
    let digest = tokio::task::spawn_blocking(move || if lfs { sha256_of(&check) } else { git_blob_id(&check) }).await.map_err(|e| Error::Fetch(e.to_string()))?.map_err(|e| io("read", &part_path, e))?;
    let (want, what) = match &f.sha256 {
        Some(sha) => (sha, "SHA-256"),
        None => (&f.blob, "git blob id"),
    };
    if &digest != want {
        let _ = std::fs::remove_file(&part_path);
        return Err(Error::Fetch(format!("{}: the download's {what} is {digest}, the hub lists {want}: removed (a broken mirror or proxy?)", f.path)));
    }
    std::fs::rename(&part_path, &blob).map_err(|e| io("rename", &part_path, e))?;
    Ok(fetched)
}

enum Resume {
    /// Worth another try (a dropped connection, a server error); bytes fetched before it.
    Retry(String, u64),
    Fail(Error),
}

/// One request for the rest of `f` after what `part` holds.
async fn resume(client: &reqwest::Client, url: &str, f: &RemoteFile, part: &Path, progress: &mut Progress) -> std::result::Result<u64, Resume> {
    let fail = |e: Error| Resume::Fail(e);
    // The cache is a folder anyone with access to it may write: no link at the name is followed.
    let mut file = crate::process::open_in_dir(part, crate::process::Open::ReadWrite).map_err(|e| fail(io("open", part, e)))?;
    let mut have = file.metadata().map_err(|e| fail(io("read", part, e)))?.len();
    if have > f.size {
        file.set_len(0).map_err(|e| fail(io("truncate", part, e)))?;
        have = 0;
    }
    if have == f.size {
        return Ok(0);
    }
    let mut request = client.get(url);
    if have > 0 {
        request = request.header(reqwest::header::RANGE, format!("bytes={have}-"));
    }
    let response = request.send().await.map_err(|e| Resume::Retry(e.to_string(), 0))?;
    let status = response.status();
    match status.as_u16() {
        206 => {
            let start = response.headers().get(reqwest::header::CONTENT_RANGE).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("bytes ")).and_then(|v| v.split('-').next()).and_then(|v| v.parse::<u64>().ok());
            if start != Some(have) {
                return Err(Resume::Retry(format!("the server resumed at {start:?}, not at byte {have}"), 0));
            }
        }
        200 => {
            // The server ignores ranges: from the start.
            file.set_len(0).map_err(|e| fail(io("truncate", part, e)))?;
            have = 0;
        }
        401 | 403 => return Err(fail(Error::Fetch(format!("{}: {status}: gated or private; set HF_TOKEN", f.path)))),
        404 => return Err(fail(Error::Fetch(format!("{}: not found at {url}", f.path)))),
        _ if status.is_server_error() || status.as_u16() == 429 => return Err(Resume::Retry(format!("{status}"), 0)),
        _ => return Err(fail(Error::Fetch(format!("{}: {status} from {url}", f.path)))),
    }
    progress.resumed(have);
    file.seek(std::io::SeekFrom::Start(have)).map_err(|e| fail(io("seek", part, e)))?;
    let mut writer = std::io::BufWriter::with_capacity(1 << 20, file);
    let mut stream = response.bytes_stream();
    let mut got = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = match chunk {
            Ok(c) => c,
            Err(e) => {
                writer.flush().map_err(|e| fail(io("write", part, e)))?;
                return Err(Resume::Retry(e.to_string(), got));
            }
        };
        if have + got + chunk.len() as u64 > f.size {
            let _ = writer.flush();
            drop(writer);
            let _ = std::fs::remove_file(part);
            return Err(fail(Error::Fetch(format!("{}: the server sent more than the {} bytes the hub lists", f.path, f.size))));
        }
        writer.write_all(&chunk).map_err(|e| fail(io("write", part, e)))?;
        got += chunk.len() as u64;
        progress.add(chunk.len() as u64);
    }
    writer.flush().map_err(|e| fail(io("write", part, e)))?;
    if have + got < f.size {
        return Err(Resume::Retry(format!("the connection ended at byte {} of {}", have + got, f.size), got));
    }
    Ok(got)
}

/// A response's body, refused once it passes `limit` bytes (before holding more).
async fn read_bounded(mut r: reqwest::Response, limit: usize) -> std::result::Result<Vec<u8>, String> {
    if r.content_length().is_some_and(|n| n > limit as u64) {
        return Err(format!("the listing is {} bytes, more than the {limit} a model repo's listing takes: refused", r.content_length().unwrap_or(0)));
    }
    let mut body = Vec::new();
    while let Some(chunk) = r.chunk().await.map_err(|e| format!("the listing could not be read: {e}"))? {
        if body.len() + chunk.len() > limit {
            return Err(format!("the listing is more than the {limit} bytes a model repo's listing takes: refused"));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// Refuses a pull whose files (what is not already in the cache) would not fit on the
/// cache's disk with `DISK_MARGIN` to spare, before any byte is fetched.
fn fits_on_disk(dir: &Path, files: &[RemoteFile], what: &str) -> Result<()> {
    let blobs = dir.join("blobs");
    let needed: u64 = files
        .iter()
        .map(|f| {
            let have = |p: PathBuf| std::fs::metadata(p).map_or(0, |m| m.len());
            if have(blobs.join(&f.blob)) == f.size {
                0
            } else {
                f.size.saturating_sub(have(blobs.join(format!("{}.incomplete", f.blob))))
            }
        })
        .sum();
    // The nearest folder that exists tells the disk.
    let Some(free) = dir.ancestors().find(|a| a.exists()).and_then(crate::process::free_bytes) else { return Ok(()) };
    if needed.saturating_add(DISK_MARGIN) > free {
        let gb = |b: u64| b as f64 / 1e9;
        return Err(Error::Fetch(format!(
            "{what} needs {:.1} GB more on the disk of {} and {:.1} GB is free (with {:.1} GB kept spare): free some space or point HF_HUB_CACHE at a bigger disk",
            gb(needed),
            dir.display(),
            gb(free),
            gb(DISK_MARGIN)
        )));
    }
    Ok(())
}

/// git's blob id of a file: SHA-1 of `blob <size>\0` and its bytes.
fn git_blob_id(path: &Path) -> std::io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha1::new();
    hasher.update(format!("blob {}\0", file.metadata()?.len()).as_bytes());
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

fn sha256_of(path: &Path) -> std::io::Result<String> {
    let mut file = std::fs::File::open(path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// An exclusive `flock` on a blob's lock file, held while the blob is downloaded.
struct BlobLock(std::fs::File);

impl BlobLock {
    async fn take(path: &Path) -> Result<BlobLock> {
        use std::os::fd::AsRawFd;
        let file = crate::process::open_in_dir(path, crate::process::Open::ReadWrite).map_err(|e| io("open", path, e))?;
        let mut told = false;
        loop {
            // SAFETY: a plain flock on an open descriptor.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                return Ok(BlobLock(file));
            }
            if !told {
                tracing::info!("another process is downloading {}: waiting for it", path.display());
                told = true;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

impl Drop for BlobLock {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: unlocking the descriptor this value owns.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// Bytes of a pull: a line redrawn on a terminal, a log line every `LOG_EVERY` otherwise,
/// and `hearth_model_pull_bytes_total` / `hearth_model_pull_remaining_bytes`.
struct Progress {
    name: String,
    total: u64,
    done: u64,
    started: Instant,
    /// Bytes that were already here when this pull started (not counted in its speed).
    already: u64,
    /// `done` when the current file started.
    file_base: u64,
    drawn: Instant,
    terminal: bool,
}

impl Progress {
    fn new(name: String, total: u64) -> Progress {
        let now = Instant::now();
        metrics::gauge!("hearth_model_pull_remaining_bytes").set(total as f64);
        Progress { name, total, done: 0, started: now, already: 0, file_base: 0, drawn: now, terminal: std::io::stderr().is_terminal() }
    }

    fn skip(&mut self, n: u64) {
        self.already += n;
        self.done += n;
    }

    fn start_file(&mut self) {
        self.file_base = self.done;
    }

    /// A request for the current file starts at byte `have`: bytes an earlier process left
    /// count as already here; a server that starts over takes back what was counted.
    fn resumed(&mut self, have: u64) {
        let now = self.file_base + have;
        if now > self.done {
            self.already += now - self.done;
        }
        self.done = now;
    }

    fn add(&mut self, n: u64) {
        self.done += n;
        metrics::counter!("hearth_model_pull_bytes_total").increment(n);
        metrics::gauge!("hearth_model_pull_remaining_bytes").set(self.total.saturating_sub(self.done) as f64);
        let every = if self.terminal { DRAW_EVERY } else { LOG_EVERY };
        if self.drawn.elapsed() >= every {
            self.drawn = Instant::now();
            self.show();
        }
    }

    fn show(&self) {
        let secs = self.started.elapsed().as_secs_f64().max(1e-3);
        let rate = (self.done - self.already.min(self.done)) as f64 / secs / 1e6;
        let pct = self.done as f64 / self.total.max(1) as f64 * 100.0;
        let line = format!("{}: {pct:5.1}% of {:.1} GB, {rate:.1} MB/s", self.name, self.total as f64 / 1e9);
        if self.terminal {
            eprint!("\r{line}   ");
        } else {
            tracing::info!("pulling {line}");
        }
    }

    fn finish(&self) {
        metrics::gauge!("hearth_model_pull_remaining_bytes").set(0.0);
        if self.terminal && self.done > self.already {
            self.show();
            eprintln!();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str) -> RemoteFile {
        RemoteFile { path: path.into(), size: 1, sha256: None, blob: "0".repeat(64) }
    }

    #[test]
    fn references_parse_as_llama_cpp_writes_them() {
        let r: ModelRef = "hf:bartowski/Qwen2.5-7B-Instruct-GGUF:Q4_K_M".parse().unwrap();
        assert_eq!(r, ModelRef { repo: "bartowski/Qwen2.5-7B-Instruct-GGUF".into(), tag: Some("Q4_K_M".into()) });
        assert_eq!("a/b".parse::<ModelRef>().unwrap().tag, None);
        assert_eq!("a/b:model-q8_0.gguf".parse::<ModelRef>().unwrap().tag.as_deref(), Some("model-q8_0.gguf"));
        for bad in ["nobody", "a/b/c", "../x", "a/..", "a/b:../../etc", "/b", "a/b c"] {
            assert!(bad.parse::<ModelRef>().is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn the_quantization_picks_the_file_and_every_part_of_a_split_one() {
        let files: Vec<RemoteFile> = [
            "README.md",
            "model-Q2_K.gguf",
            "model-Q4_K_M_L.gguf",
            "model-Q8_0.gguf",
            "Q4_K_M/model-Q4_K_M-00002-of-00002.gguf",
            "Q4_K_M/model-Q4_K_M-00001-of-00002.gguf",
            "mmproj-model-Q4_K_M.gguf",
        ]
        .map(file)
        .to_vec();
        let paths = |(fs, _): (Vec<RemoteFile>, String)| fs.into_iter().map(|f| f.path).collect::<Vec<_>>();
        assert_eq!(paths(choose(&files, Some("q4_k_m")).unwrap()), ["Q4_K_M/model-Q4_K_M-00001-of-00002.gguf", "Q4_K_M/model-Q4_K_M-00002-of-00002.gguf"]);
        assert_eq!(paths(choose(&files, None).unwrap()), paths(choose(&files, Some("Q4_K_M")).unwrap()), "Q4_K_M by default");
        assert_eq!(paths(choose(&files, Some("Q8_0")).unwrap()), ["model-Q8_0.gguf"]);
        assert_eq!(paths(choose(&files, Some("model-Q2_K.gguf")).unwrap()), ["model-Q2_K.gguf"]);
        let e = choose(&files, Some("IQ2_XS")).unwrap_err().to_string();
        assert!(e.contains("no IQ2_XS file") && e.contains("model-Q8_0.gguf") && !e.contains("mmproj"), "{e}");
        // No default quantization: the first model file, and a part missing is an error.
        let plain = ["model-Q2_K.gguf", "x-Q5_K_M-00001-of-00003.gguf", "x-Q5_K_M-00003-of-00003.gguf"].map(file).to_vec();
        assert_eq!(paths(choose(&plain, None).unwrap()), ["model-Q2_K.gguf"]);
        let e = choose(&plain, Some("Q5_K_M")).unwrap_err().to_string();
        assert!(e.contains("x-Q5_K_M-00002-of-00003.gguf"), "{e}");
    }

    #[test]
    fn hub_paths_that_would_leave_the_cache_are_refused() {
        for bad in ["../x.gguf", "a/../../x.gguf", "/etc/passwd", "a//b.gguf", "a\\b.gguf", ""] {
            assert!(!safe_path(bad), "{bad}");
        }
        assert!(safe_path("Q4_K_M/model-Q4_K_M-00001-of-00002.gguf"));
        assert!(!hex_name("../../etc") && hex_name(&"ab".repeat(32)));
    }
}
