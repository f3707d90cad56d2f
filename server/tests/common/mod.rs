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

/// `hearth serve ARGS --model <default> --port 0` built and served in this process (the
/// router on a tokio listener); its base URL and state.
pub async fn serve_in_process(args: &[&str]) -> (String, std::sync::Arc<hearth::http::AppState>) {
    serve_model_in_process(&default_model(), args).await
}

/// `hearth serve ARGS --model MODEL --port 0` as `build` takes it: its error where the
/// flags or the model are refused.
pub fn build(model: &std::path::Path, args: &[&str]) -> Result<(std::sync::Arc<hearth::http::AppState>, std::net::SocketAddr), Box<dyn std::error::Error>> {
    use clap::Parser;
    use hearth::cli::{Cli, Command};
    let model = model.to_string_lossy().into_owned();
    // The prompt cache in RAM only: nothing read from or left in the user's cache directory.
    let mut argv = vec!["hearth", "serve", "--port", "0", "--prompt-cache-size", "0"];
    argv.extend_from_slice(args);
    argv.extend_from_slice(&["--model", &model]);
    let Command::Serve(args) = Cli::parse_from(argv).command else { unreachable!() };
    hearth::cli::serve::build(&args)
}

/// [`serve_in_process`] on another model.
pub async fn serve_model_in_process(model: &std::path::Path, args: &[&str]) -> (String, std::sync::Arc<hearth::http::AppState>) {
    let (state, addr) = build(model, args).unwrap();
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let app = hearth::http::router(state.clone());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (base, state)
}

/// A tiny random embedding model of `arch` (`bert`, `nomic-bert`, or `qwen3` with
/// last-token pooling), written once per process.
pub fn tiny_embedding_model(arch: &str) -> PathBuf {
    engine::random_model::RandomModel::tiny_embedder_file(arch, &default_model()).unwrap()
}
