//! Where models live and how the default one is fetched: the project's own script
//! (scripts/fetch-model.sh), compiled into the binary so an installed `hearth` can fetch
//! too. A leaf: the CLI resolves `--model` with it, tests find the default model with it.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{Error, Result};

pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const FETCH_SCRIPT: &str = include_str!("../../scripts/fetch-model.sh");

/// Where models live: `$HEARTH_MODELS_DIR`, else `./models`.
pub fn models_dir() -> PathBuf {
    std::env::var_os("HEARTH_MODELS_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("models"))
}

/// The models in `dir` (its GGUF files, a split set once): file names and bytes.
pub fn local_models(dir: &Path) -> Vec<(String, u64)> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let files: Vec<(String, u64)> = entries
        .flatten()
        // Through links: people link models into the folder from elsewhere (only read here).
        .filter_map(|e| Some((e.file_name().to_string_lossy().into_owned(), std::fs::metadata(e.path()).ok().filter(|m| m.is_file())?.len())))
        .collect();
    let mut out = model_sets(files.iter().map(|(p, b)| (p.as_str(), *b)));
    out.sort();
    out
}

/// Files that sit beside models in GGUF repos but are not one.
const NOT_MODELS: [&str; 3] = ["mmproj", "imatrix", "mtp-"];

/// Whether `path` names a model file (not a projector, an importance matrix or an MTP head).
pub fn is_model(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path).to_ascii_lowercase();
    name.ends_with(".gguf") && !NOT_MODELS.iter().any(|n| name.contains(n))
}

/// The models among `(path, bytes)` files: every GGUF model file but the later parts of a
/// split set, whose bytes count under its first part.
pub fn model_sets<'a>(files: impl Iterator<Item = (&'a str, u64)> + Clone) -> Vec<(String, u64)> {
    let models = files.clone().filter(|(p, _)| is_model(p));
    models
        .filter_map(|(path, bytes)| match engine::gguf::split::split_part(path) {
            None => Some((path.to_string(), bytes)),
            Some((prefix, 1, _)) => Some((path.to_string(), files.clone().filter(|(p, _)| engine::gguf::split::split_part(p).is_some_and(|(q, _, _)| q == prefix)).map(|(_, b)| b).sum())),
            Some(_) => None,
        })
        .collect()
}

/// The default model in `dir`, fetched (and checked by SHA-256) if it is not there yet.
pub fn ensure_default_model(dir: &Path) -> Result<PathBuf> {
    let out = Command::new("bash")
        .arg("-c")
        .arg(FETCH_SCRIPT)
        .env("HEARTH_MODELS_DIR", dir)
        .output()
        .map_err(|e| Error::Fetch(format!("cannot run bash: {e}")))?;
    if !out.status.success() {
        return Err(Error::Fetch(format!("fetching {DEFAULT_MODEL_FILE} failed: {}", String::from_utf8_lossy(&out.stderr).trim())));
    }
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if !path.is_file() {
        return Err(Error::Fetch(format!("the fetch script reported {} but it is not a file", path.display())));
    }
    Ok(path)
}

/// The default model's vocabulary without its weights (`testdata/`, checked in; made by
/// `engine::random_model::write_vocabulary`): what the in-process tests tokenize with, so
/// `cargo test --lib` downloads nothing.
#[cfg(test)]
pub(crate) fn vocabulary_fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/smollm2-vocab.gguf")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folders_models_are_its_gguf_files_with_a_split_set_once() {
        let dir = std::env::temp_dir().join(format!("hearth-local-models-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("sub.gguf")).unwrap();
        for (name, len) in [("a.gguf", 3), ("b-00001-of-00002.gguf", 5), ("b-00002-of-00002.gguf", 7), ("mmproj-a.gguf", 11), ("notes.txt", 13)] {
            std::fs::write(dir.join(name), vec![0u8; len]).unwrap();
        }
        // A model linked in from elsewhere counts; a dangling link does not.
        std::os::unix::fs::symlink(dir.join("a.gguf"), dir.join("linked.gguf")).unwrap();
        std::os::unix::fs::symlink(dir.join("gone.gguf"), dir.join("dangling.gguf")).unwrap();
        let got = local_models(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(got, [("a.gguf".to_string(), 3), ("b-00001-of-00002.gguf".to_string(), 12), ("linked.gguf".to_string(), 3)]);
    }
}
