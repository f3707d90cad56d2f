//! Shared by the server's in-process tests: the default model, and the vocabulary fixture
//! for tests that need a real tokenizer and no weights (no download).
#![allow(dead_code)]

use std::path::PathBuf;

/// The default model's vocabulary without its weights (`testdata/`, checked in).
pub fn vocabulary_fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/smollm2-vocab.gguf")
}

pub fn default_model() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models");
    hearth::models::ensure_default_model(&dir).expect("fetch the default model")
}
