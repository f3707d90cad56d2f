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
