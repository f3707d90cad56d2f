//! Shared by the server's in-process tests: the default model.

use std::path::PathBuf;

pub fn default_model() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models");
    hearth::models::ensure_default_model(&dir).expect("fetch the default model")
}
