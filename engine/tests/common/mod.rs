//! Shared by the engine's integration tests: the default model (fetched once by the
//! project's script) and the prompts the oracle tests use.
#![allow(dead_code)]

use std::path::PathBuf;

pub fn default_model() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models");
    engine::default_model::ensure_default_model(&dir).expect("fetch the default model")
}

/// Threads per test: tests run in parallel on small machines, and oversubscribed ggml
/// thread pools spin each other to a crawl.
pub const THREADS: usize = 1;
