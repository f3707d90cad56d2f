//! `hearth pull` and `hearth models`: models by name from the hub, and what is on this
//! machine.

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::{ModelsArgs, PullArgs};
use crate::hub::{self, Hub, ModelRef};

pub fn run(args: PullArgs) -> Result<(), Box<dyn std::error::Error>> {
    let path = resolve(&args.model)?;
    println!("{}", path.display());
    Ok(())
}

/// `--model hf:owner/name[:QUANT]`: the model's first file in the hub cache, pulled first
/// if the cache lacks any of it.
pub fn resolve(reference: &str) -> crate::Result<PathBuf> {
    let model: ModelRef = reference.parse()?;
    let hub = Hub::from_env();
    tracing::info!(model = %model, endpoint = %hub.endpoint, cache = %hub.cache.display(), "pulling");
    let pulled = hub::pull(&hub, &model)?;
    let bytes: u64 = pulled.files.iter().map(|f| f.size).sum();
    let parts = if pulled.files.len() > 1 { format!(" in {} parts", pulled.files.len()) } else { String::new() };
    if pulled.downloaded > 0 {
        tracing::info!("pulled {model}: {}, {:.2} GB{parts} ({:.2} GB downloaded), commit {}", pulled.why, bytes as f64 / 1e9, pulled.downloaded as f64 / 1e9, &pulled.commit[..12.min(pulled.commit.len())]);
    } else {
        tracing::info!("{model}: {}, {:.2} GB{parts}, already here", pulled.why, bytes as f64 / 1e9);
    }
    Ok(pulled.path)
}

/// One local model, as `hearth models` lists it.
#[derive(Debug, Serialize)]
struct Local {
    /// `owner/name:FILE` for a pulled model, the file name in the models folder.
    name: String,
    bytes: u64,
    parts: usize,
    architecture: Option<String>,
    quantization: Option<String>,
    path: PathBuf,
}

pub fn models(args: ModelsArgs) -> Result<(), Box<dyn std::error::Error>> {
    let hub = Hub::from_env();
    if let Some(name) = &args.remove {
        let removed = remove(&hub, &name.parse()?)?;
        println!("removed {name} ({:.2} GB freed)", removed as f64 / 1e9);
        return Ok(());
    }
    let mut found = Vec::new();
    for path in gguf_files(&crate::models::models_dir()) {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        found.push(describe(name, &path));
    }
    if let Ok(repos) = std::fs::read_dir(&hub.cache) {
        let mut repos: Vec<PathBuf> = repos.flatten().map(|e| e.path()).collect();
        repos.sort();
        for dir in repos {
            let Some(repo) = dir.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix("models--")).map(|n| n.replacen("--", "/", 1)) else { continue };
            let Ok(commit) = std::fs::read_to_string(dir.join("refs").join("main")) else { continue };
            let snapshot = dir.join("snapshots").join(commit.trim());
            for path in gguf_files(&snapshot) {
                let rel = path.strip_prefix(&snapshot).unwrap_or(&path).to_string_lossy().into_owned();
                found.push(describe(format!("{repo}:{rel}"), &path));
            }
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&found)?);
        return Ok(());
    }
    println!("{:<60} {:>9}  {:<10} {:<8} path", "name", "size", "arch", "quant");
    for m in &found {
        let parts = if m.parts > 1 { format!(" ({} parts)", m.parts) } else { String::new() };
        println!("{:<60} {:>7.2}GB  {:<10} {:<8} {}{parts}", m.name, m.bytes as f64 / 1e9, m.architecture.as_deref().unwrap_or("?"), m.quantization.as_deref().unwrap_or("?"), m.path.display());
    }
    if found.is_empty() {
        println!("(none: `hearth pull owner/name:QUANT` downloads one; the hub cache is {})", hub.cache.display());
    }
    Ok(())
}

/// GGUF model files under `dir` (a split model's first part only), sorted.
fn gguf_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x.eq_ignore_ascii_case("gguf")) {
                let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                if split_parts(&p).is_none_or(|(no, _)| no == 1) && !name.contains("mmproj") {
                    out.push(p);
                }
            }
        }
    }
    out.sort();
    out
}

/// (part, count) of a `-0000k-of-0000n.gguf` file.
fn split_parts(p: &Path) -> Option<(u32, u32)> {
    hub::split_part(p.file_name()?.to_str()?).map(|(_, no, count)| (no, count))
}

fn describe(name: String, path: &Path) -> Local {
    // Opened as the engine opens it (every part of a split set); a set with a part
    // missing is counted by name, with what of it is here.
    let header = engine::gguf::GgufFile::open(path).ok();
    let (parts, bytes) = match &header {
        Some(g) => (g.parts().len(), g.parts().iter().map(|p| p.len()).sum()),
        None => {
            let files = split_parts(path).and_then(|(no, n)| engine::gguf::split::part_paths(path, u64::from(no) - 1, n.into())).unwrap_or_else(|| vec![path.to_path_buf()]);
            (files.len(), files.iter().filter_map(|f| std::fs::metadata(f).ok()).map(|m| m.len()).sum())
        }
    };
    let architecture = header.as_ref().and_then(|g| g.get_str("general.architecture").map(str::to_string));
    let quantization = header.as_ref().and_then(|g| g.get_u64("general.file_type")).and_then(|t| engine::reference::file_type_name(t as u32)).map(str::to_ascii_uppercase);
    Local { name, bytes, parts, architecture, quantization, path: path.to_path_buf() }
}

/// Deletes a pulled model's files (links and blobs) from the cache; the repo's folder too
/// when nothing else of it is left. Returns the bytes freed.
fn remove(hub: &Hub, model: &ModelRef) -> crate::Result<u64> {
    let pulled = hub::cached(hub, model).ok_or_else(|| crate::Error::Fetch(format!("{model} is not in the hub cache ({})", hub.cache.display())))?;
    let snapshot = pulled.path.ancestors().nth(pulled.files[0].path.split('/').count()).map(Path::to_path_buf).unwrap_or_default();
    let mut freed = 0;
    // Only blobs of this repo: a link planted in the snapshot must not delete what it points at.
    let blobs = std::fs::canonicalize(snapshot.ancestors().nth(2).unwrap_or(&snapshot).join("blobs")).ok();
    for f in &pulled.files {
        let link = snapshot.join(&f.path);
        if let Some(blob) = std::fs::canonicalize(&link).ok().filter(|b| blobs.as_ref().is_some_and(|d| b.parent() == Some(d.as_path()))) {
            freed += std::fs::metadata(&blob).map(|m| m.len()).unwrap_or(0);
            std::fs::remove_file(&blob).map_err(|e| crate::Error::Fetch(format!("cannot remove {}: {e}", blob.display())))?;
        }
        std::fs::remove_file(&link).map_err(|e| crate::Error::Fetch(format!("cannot remove {}: {e}", link.display())))?;
    }
    // The repo's folder goes when no model file of it is left.
    let repo_dir = snapshot.ancestors().nth(2).map(Path::to_path_buf).unwrap_or_default();
    if repo_dir.file_name().is_some_and(|n| n.to_string_lossy().starts_with("models--")) && gguf_files(&repo_dir.join("snapshots")).is_empty() {
        let _ = std::fs::remove_dir_all(&repo_dir);
    }
    Ok(freed)
}
