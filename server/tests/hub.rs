//! Pulling models by name against a local stand-in for the Hugging Face hub (no traffic
//! leaves the machine): the endpoints hearth uses (the repo listing with sizes and SHA-256s,
//! `resolve` redirecting to storage on another port), a connection dropped mid-file, a
//! download killed part way, a mirror whose bytes are not the listed ones, a split model,
//! and the hub's cache layout afterwards; then `hearth pull` and `hearth models` as a user
//! runs them.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use hearth::hub::{self, Hub, ModelRef};
use sha2::{Digest, Sha256};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const TOKEN: &str = "hf_standin_token";

fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// What one storage request asked for and carried.
#[derive(Debug, Clone)]
struct Served {
    blob: String,
    range: Option<String>,
    authorized: bool,
}

#[derive(Default)]
struct Stand {
    /// repo -> (path, bytes)
    repos: HashMap<String, Vec<(String, Vec<u8>)>>,
    /// A blob whose listed SHA-256 is not its bytes' (a broken mirror).
    wrong_sha: Option<String>,
    /// (blob, bytes): the first request for that blob ends after so many bytes.
    drop_once: Mutex<Option<(String, usize)>>,
    storage: Mutex<Vec<Served>>,
    /// Authorization headers the hub's own endpoints saw.
    hub_auth: Mutex<Vec<bool>>,
    storage_url: Mutex<String>,
    /// (path, size): the listing claims this size for that file.
    claimed_size: Option<(String, u64)>,
    /// Files listed as kept in git (no LFS entry: a size and a git blob id).
    in_git: Vec<String>,
    /// A file in git whose listed blob id is not its bytes'.
    wrong_blob_id: Option<String>,
    /// Made-up entries added to the listing (a hostile mirror's endless listing).
    extra_siblings: usize,
}

/// git's blob id of `bytes`.
fn git_blob_id(bytes: &[u8]) -> String {
    use sha1::Digest as _;
    let mut h = sha1::Sha1::new();
    h.update(format!("blob {}\0", bytes.len()).as_bytes());
    h.update(bytes);
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

type Shared = Arc<Stand>;

fn authorized(h: &HeaderMap) -> bool {
    h.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) == Some(&format!("Bearer {TOKEN}"))
}

async fn listing(State(s): State<Shared>, UrlPath((owner, name, _rev)): UrlPath<(String, String, String)>, h: HeaderMap) -> Response {
    s.hub_auth.lock().unwrap().push(authorized(&h));
    let Some(files) = s.repos.get(&format!("{owner}/{name}")) else { return StatusCode::NOT_FOUND.into_response() };
    let mut siblings: Vec<serde_json::Value> = files
        .iter()
        .map(|(path, bytes)| {
            let mut sha = sha256(bytes);
            if s.wrong_sha.as_deref() == Some(path.as_str()) {
                sha = sha256(b"something else");
            }
            let size = s.claimed_size.as_ref().filter(|(p, _)| p == path).map_or(bytes.len() as u64, |(_, n)| *n);
            if s.in_git.contains(path) {
                let blob = if s.wrong_blob_id.as_deref() == Some(path.as_str()) { git_blob_id(b"something else") } else { git_blob_id(bytes) };
                return serde_json::json!({"rfilename": path, "size": size, "blobId": blob});
            }
            serde_json::json!({"rfilename": path, "size": size, "blobId": "ab".repeat(20), "lfs": {"sha256": sha, "size": size, "pointerSize": 130}})
        })
        .collect();
    siblings.extend((0..s.extra_siblings).map(|i| serde_json::json!({"rfilename": format!("padding/file-{i:08}.bin"), "size": 1, "blobId": "cd".repeat(20), "lfs": {"sha256": "ef".repeat(32), "size": 1, "pointerSize": 130}})));
    axum::Json(serde_json::json!({"id": format!("{owner}/{name}"), "sha": COMMIT, "siblings": siblings})).into_response()
}

async fn resolve(State(s): State<Shared>, UrlPath((owner, name, rev, path)): UrlPath<(String, String, String, String)>, h: HeaderMap) -> Response {
    s.hub_auth.lock().unwrap().push(authorized(&h));
    let Some((_, bytes)) = s.repos.get(&format!("{owner}/{name}")).and_then(|fs| fs.iter().find(|(p, _)| *p == path)) else { return StatusCode::NOT_FOUND.into_response() };
    assert_eq!(rev, COMMIT, "files are fetched from the listed commit");
    let to = format!("{}/blobs/{}", s.storage_url.lock().unwrap(), sha256(bytes));
    (StatusCode::FOUND, [(header::LOCATION, to), (header::HeaderName::from_static("x-repo-commit"), COMMIT.to_string())]).into_response()
}

async fn storage(State(s): State<Shared>, UrlPath(blob): UrlPath<String>, h: HeaderMap) -> Response {
    let range = h.get(header::RANGE).and_then(|v| v.to_str().ok()).map(str::to_string);
    s.storage.lock().unwrap().push(Served { blob: blob.clone(), range: range.clone(), authorized: h.contains_key(header::AUTHORIZATION) });
    let Some(bytes) = s.repos.values().flatten().map(|(_, b)| b).find(|b| sha256(b) == blob).cloned() else { return StatusCode::NOT_FOUND.into_response() };
    let start: usize = range.as_deref().and_then(|r| r.strip_prefix("bytes=")).and_then(|r| r.strip_suffix('-')).and_then(|r| r.parse().ok()).unwrap_or(0);
    let body = bytes[start.min(bytes.len())..].to_vec();
    let status = if range.is_some() { StatusCode::PARTIAL_CONTENT } else { StatusCode::OK };
    let mut headers = vec![(header::CONTENT_LENGTH, body.len().to_string())];
    if range.is_some() {
        headers.push((header::CONTENT_RANGE, format!("bytes {start}-{}/{}", bytes.len() - 1, bytes.len())));
    }
    let cut = {
        let mut d = s.drop_once.lock().unwrap();
        match d.as_ref() {
            Some((b, n)) if *b == blob => {
                let n = *n;
                *d = None;
                Some(n)
            }
            _ => None,
        }
    };
    let body = match cut {
        // The connection dies after `n` bytes of a response that promised more.
        Some(n) => Body::from_stream(futures::stream::iter(vec![Ok(bytes::Bytes::from(body[..n].to_vec())), Err(std::io::Error::other("connection lost"))])),
        None => Body::from(body),
    };
    let mut r = Response::builder().status(status);
    for (k, v) in headers {
        r = r.header(k, v);
    }
    r.body(body).unwrap()
}

/// Starts the stand-in: the hub on one port, its storage on another (another origin, as
/// the real hub's storage is, so the token must not follow the redirect there).
fn start(stand: Stand) -> (Shared, String, tokio::runtime::Runtime) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let shared = Arc::new(stand);
    let hub_app = axum::Router::new()
        .route("/api/models/{owner}/{name}/revision/{rev}", get(listing))
        .route("/{owner}/{name}/resolve/{rev}/{*path}", get(resolve))
        .with_state(shared.clone());
    let storage_app = axum::Router::new().route("/blobs/{blob}", get(storage)).with_state(shared.clone());
    let (hub_addr, storage_addr) = rt.block_on(async {
        let h = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let s = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addrs = (h.local_addr().unwrap(), s.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(h, hub_app).await.unwrap() });
        tokio::spawn(async move { axum::serve(s, storage_app).await.unwrap() });
        addrs
    });
    *shared.storage_url.lock().unwrap() = format!("http://localhost:{}", storage_addr.port());
    (shared, format!("http://127.0.0.1:{}", hub_addr.port()), rt)
}

fn random_bytes(n: usize, seed: u8) -> Vec<u8> {
    let mut x = seed as u64 + 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("hearth-hub-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

const PART_BYTES: usize = 3 << 20;

#[test]
fn a_split_model_is_pulled_by_quantization_resumed_after_a_dropped_connection_and_found_offline() {
    let part1 = random_bytes(PART_BYTES, 1);
    let part2 = random_bytes(PART_BYTES + 12345, 2);
    let other = random_bytes(1000, 3);
    let mut stand = Stand::default();
    stand.repos.insert(
        "someone/Model-GGUF".into(),
        vec![
            ("README.md".into(), b"# a model".to_vec()),
            ("model-Q8_0.gguf".into(), other.clone()),
            ("Q4_K_M/model-Q4_K_M-00002-of-00002.gguf".into(), part2.clone()),
            ("Q4_K_M/model-Q4_K_M-00001-of-00002.gguf".into(), part1.clone()),
        ],
    );
    *stand.drop_once.lock().unwrap() = Some((sha256(&part2), 1 << 20));
    let (shared, endpoint, _rt) = start(stand);
    let cache = scratch("split");
    let hub = Hub { endpoint: endpoint.clone(), token: Some(TOKEN.into()), cache: cache.clone() };
    let model: ModelRef = "hf:someone/Model-GGUF:q4_k_m".parse().unwrap();

    let pulled = hub::pull(&hub, &model).unwrap();
    let snapshot = cache.join("models--someone--Model-GGUF/snapshots").join(COMMIT);
    assert_eq!(pulled.path, snapshot.join("Q4_K_M/model-Q4_K_M-00001-of-00002.gguf"));
    assert_eq!(std::fs::read(&pulled.path).unwrap(), part1);
    assert_eq!(std::fs::read(snapshot.join("Q4_K_M/model-Q4_K_M-00002-of-00002.gguf")).unwrap(), part2);
    assert_eq!(pulled.downloaded, (part1.len() + part2.len()) as u64, "every byte once, the resumed part included");
    // The hub's cache layout: refs/main, blobs named by SHA-256, relative links.
    let dir = cache.join("models--someone--Model-GGUF");
    assert_eq!(std::fs::read_to_string(dir.join("refs/main")).unwrap(), COMMIT);
    assert!(dir.join("blobs").join(sha256(&part2)).is_file());
    assert_eq!(std::fs::read_link(&pulled.path).unwrap(), Path::new("../../../blobs").join(sha256(&part1)));
    assert!(!snapshot.join("model-Q8_0.gguf").exists(), "only the chosen quantization");
    let served = shared.storage.lock().unwrap().clone();
    let second: Vec<&Served> = served.iter().filter(|s| s.blob == sha256(&part2)).collect();
    assert_eq!(second.len(), 2, "{served:?}");
    assert_eq!(second[1].range.as_deref(), Some("bytes=1048576-"), "the dropped download resumed where it stopped");
    assert!(shared.hub_auth.lock().unwrap().iter().all(|a| *a), "the hub saw the token");
    assert!(served.iter().all(|s| !s.authorized), "the token went to the storage host: {served:?}");

    // Again: nothing downloaded. Then with the hub unreachable: the cache answers.
    let again = hub::pull(&hub, &model).unwrap();
    assert_eq!((again.path.clone(), again.downloaded), (pulled.path.clone(), 0));
    assert_eq!(shared.storage.lock().unwrap().len(), served.len());
    let offline = Hub { endpoint: "http://127.0.0.1:9".into(), ..hub.clone() };
    assert_eq!(hub::pull(&offline, &model).unwrap().path, pulled.path);
    // A quantization the repo lacks names what it has.
    let e = hub::pull(&hub, &"someone/Model-GGUF:IQ2_XS".parse().unwrap()).unwrap_err().to_string();
    assert!(e.contains("IQ2_XS") && e.contains("model-Q8_0.gguf"), "{e}");
    let e = hub::pull(&hub, &"someone/Nothing".parse().unwrap()).unwrap_err().to_string();
    assert!(e.contains("no model someone/Nothing"), "{e}");
    std::fs::remove_dir_all(&cache).unwrap();
}

#[test]
fn bytes_that_are_not_the_listed_ones_are_refused_and_a_killed_pull_resumes() {
    let good = random_bytes(PART_BYTES, 4);
    let bad = random_bytes(50_000, 5);
    let mut stand = Stand::default();
    stand.repos.insert("someone/Good-GGUF".into(), vec![("good-Q4_0.gguf".into(), good.clone())]);
    stand.repos.insert("someone/Bad-GGUF".into(), vec![("bad-Q4_0.gguf".into(), bad.clone())]);
    stand.wrong_sha = Some("bad-Q4_0.gguf".into());
    let (shared, endpoint, _rt) = start(stand);
    let cache = scratch("checks");
    let hub = Hub { endpoint, token: None, cache: cache.clone() };

    let e = hub::pull(&hub, &"someone/Bad-GGUF".parse().unwrap()).unwrap_err().to_string();
    assert!(e.contains("SHA-256"), "{e}");
    let blobs = cache.join("models--someone--Bad-GGUF/blobs");
    let left: Vec<_> = std::fs::read_dir(&blobs).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| !n.ends_with(".lock")).collect();
    assert!(left.is_empty(), "wrong bytes were kept: {left:?}");

    // A link planted at the partial blob's name is not written through.
    let blobs = cache.join("models--someone--Good-GGUF/blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    let outside = cache.join("precious");
    std::fs::write(&outside, b"precious").unwrap();
    std::os::unix::fs::symlink(&outside, blobs.join(format!("{}.incomplete", sha256(&good)))).unwrap();
    let e = hub::pull(&hub, &"someone/Good-GGUF".parse().unwrap()).unwrap_err().to_string();
    assert!(e.contains("symbolic link"), "{e}");
    assert_eq!(std::fs::read(&outside).unwrap(), b"precious");
    std::fs::remove_file(blobs.join(format!("{}.incomplete", sha256(&good)))).unwrap();
    // A pull killed after 100,000 bytes left its partial blob: the next one asks for the rest.
    std::fs::write(blobs.join(format!("{}.incomplete", sha256(&good))), &good[..100_000]).unwrap();
    let pulled = hub::pull(&hub, &"someone/Good-GGUF:Q4_0".parse().unwrap()).unwrap();
    assert_eq!(std::fs::read(&pulled.path).unwrap(), good);
    assert_eq!(pulled.downloaded, (good.len() - 100_000) as u64);
    let served = shared.storage.lock().unwrap().clone();
    assert_eq!(served.last().unwrap().range.as_deref(), Some("bytes=100000-"), "{served:?}");
    // A partial blob with wrong bytes in it is caught by the checksum too, and fetched again.
    std::fs::remove_file(blobs.join(sha256(&good))).unwrap();
    let mut wrong = good[..200_000].to_vec();
    wrong[150_000] ^= 1;
    std::fs::write(blobs.join(format!("{}.incomplete", sha256(&good))), &wrong).unwrap();
    let e = hub::pull(&hub, &"someone/Good-GGUF".parse().unwrap()).unwrap_err().to_string();
    assert!(e.contains("SHA-256"), "{e}");
    let pulled = hub::pull(&hub, &"someone/Good-GGUF".parse().unwrap()).unwrap();
    assert_eq!(std::fs::read(&pulled.path).unwrap(), good);
    std::fs::remove_dir_all(&cache).unwrap();
}

/// Pulls that cannot fit or cannot be checked are refused: a listing claiming more than the
/// disk holds is refused before the first byte (nothing fetched, nothing written), a
/// listing larger than any model repo's is refused without being held whole, and a small
/// file kept in git is checked by its git blob id (kept when it matches, refused when not).
#[test]
fn pulls_that_cannot_fit_or_cannot_be_checked_are_refused() {
    let small = random_bytes(40_000, 6);
    let mut stand = Stand::default();
    stand.repos.insert("someone/Huge-GGUF".into(), vec![("huge-Q4_0.gguf".into(), random_bytes(1000, 7))]);
    stand.claimed_size = Some(("huge-Q4_0.gguf".into(), 1 << 40));
    stand.repos.insert("someone/Tiny-GGUF".into(), vec![("tiny-Q8_0.gguf".into(), small.clone())]);
    stand.repos.insert("someone/Forged-GGUF".into(), vec![("forged-Q8_0.gguf".into(), random_bytes(30_000, 8))]);
    stand.in_git = vec!["tiny-Q8_0.gguf".into(), "forged-Q8_0.gguf".into()];
    stand.wrong_blob_id = Some("forged-Q8_0.gguf".into());
    let (shared, endpoint, _rt) = start(stand);
    let cache = scratch("refusals");
    let hub = Hub { endpoint, token: None, cache: cache.clone() };

    let e = hub::pull(&hub, &"someone/Huge-GGUF".parse().unwrap()).unwrap_err().to_string();
    assert!(e.contains("needs 1099.5 GB") && e.contains("free"), "{e}");
    assert!(shared.storage.lock().unwrap().is_empty(), "nothing fetched");
    assert!(!cache.join("models--someone--Huge-GGUF/blobs").exists(), "nothing written");

    // A small file kept in git: its blob id checked.
    let pulled = hub::pull(&hub, &"someone/Tiny-GGUF".parse().unwrap()).unwrap();
    assert_eq!(std::fs::read(&pulled.path).unwrap(), small);
    let e = hub::pull(&hub, &"someone/Forged-GGUF".parse().unwrap()).unwrap_err().to_string();
    assert!(e.contains("git blob id"), "{e}");
    let blobs = cache.join("models--someone--Forged-GGUF/blobs");
    let left: Vec<_> = std::fs::read_dir(&blobs).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| !n.ends_with(".lock")).collect();
    assert!(left.is_empty(), "unverified bytes were kept: {left:?}");
    std::fs::remove_dir_all(&cache).unwrap();

    // A listing of 100,000 made-up files (~17 MB): refused.
    let mut stand = Stand::default();
    stand.repos.insert("someone/Endless-GGUF".into(), vec![("endless-Q4_0.gguf".into(), random_bytes(1000, 9))]);
    stand.extra_siblings = 100_000;
    let (_shared, endpoint, _rt2) = start(stand);
    let cache = scratch("endless");
    let hub = Hub { endpoint, token: None, cache: cache.clone() };
    let e = hub::pull(&hub, &"someone/Endless-GGUF".parse().unwrap()).unwrap_err().to_string();
    assert!(e.contains("listing") && e.contains("refused"), "{e}");
    std::fs::remove_dir_all(&cache).ok();
}

/// The commands as a user runs them: `hearth pull` prints the path of the real default
/// model pulled from the stand-in, `hearth serve --model hf:…` serves it from the cache,
/// `hearth models` lists it with its architecture and quantization, `hearth models
/// --remove` deletes it.
#[test]
fn hearth_pull_and_hearth_models_as_a_user_runs_them() {
    let model = std::fs::read(common::default_model()).unwrap();
    let mut stand = Stand::default();
    stand.repos.insert("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF".into(), vec![("smollm2-135m-instruct-q4_1.gguf".into(), model.clone())]);
    let (_shared, endpoint, _rt) = start(stand);
    let home = scratch("cli");
    let hearth = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_hearth"))
            .args(args)
            .env("HF_ENDPOINT", &endpoint)
            .env("HF_HOME", &home)
            .env("HEARTH_MODELS_DIR", home.join("models"))
            .env_remove("HF_TOKEN")
            .env_remove("HF_HUB_CACHE")
            .output()
            .unwrap();
        assert!(out.status.success(), "hearth {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let path = PathBuf::from(hearth(&["pull", "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1"]).trim());
    {
        use std::io::{BufRead, BufReader, Read, Write};
        let mut serve = std::process::Command::new(env!("CARGO_BIN_EXE_hearth"))
            .args(["serve", "--port", "0", "--threads", "1", "--parallel", "1", "--model", "hf:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1"])
            .env("HF_ENDPOINT", &endpoint)
            .env("HF_HOME", &home)
            .env("HEARTH_NO_DISCOVERY", "true")
            .env("HEARTH_LOG", "info")
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(serve.stderr.take().unwrap()).lines();
        let mut log = String::new();
        let addr = loop {
            let line = lines.next().unwrap_or_else(|| panic!("hearth serve exited:\n{log}")).unwrap();
            if let Some(a) = line.split("listening on http://").nth(1) {
                break a.trim().to_string();
            }
            log.push_str(&line);
            log.push('\n');
        };
        assert!(log.contains("already here"), "the served model came from the cache: {log}");
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.write_all(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        assert!(answer.starts_with("HTTP/1.1 200") && answer.contains("smollm2-135m-instruct-q4_1"), "{answer}");
        serve.kill().unwrap();
        serve.wait().unwrap();
    }
    assert!(path.starts_with(home.join("hub/models--HuggingFaceTB--SmolLM2-135M-Instruct-GGUF/snapshots")), "{}", path.display());
    assert_eq!(std::fs::read(&path).unwrap(), model);
    let listed = hearth(&["models"]);
    let line = listed.lines().find(|l| l.contains("smollm2-135m-instruct-q4_1.gguf")).unwrap_or_else(|| panic!("{listed}"));
    assert!(line.contains("llama") && line.contains("Q4_1"), "{line}");
    let removed = hearth(&["models", "--remove", "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1"]);
    assert!(removed.contains("removed"), "{removed}");
    assert!(!path.exists() && !home.join("hub/models--HuggingFaceTB--SmolLM2-135M-Instruct-GGUF").exists());
    assert!(!hearth(&["models"]).contains("smollm2"));
    std::fs::remove_dir_all(&home).unwrap();
}
