//! The client libraries people point at a home server, unchanged, against a running
//! `hearth serve` on the default model, alone and as the head of a 3-member ring: Anthropic's
//! SDK (clients/anthropic_sdk.py: messages, streams, count_tokens, a 10-turn tool-calling
//! agent loop, errors) and the `ollama` client (clients/ollama_sdk.py: list, show, ps, pull,
//! chat and generate whole and streamed, JSON formats, a 10-turn conversation with tools,
//! errors), and OpenAI's SDK on the Responses API (clients/openai_responses.py: create,
//! stream, retrieve, delete, previous_response_id, structured output, a 10-turn function
//! loop, Codex's stateless streamed shape), and both on embeddings (clients/embeddings_sdk.py,
//! a tiny BERT served with `--embedding-model`). The scripts need the PyPI packages
//! scripts/setup.sh installs.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::Served;

/// A context that holds the 10-turn agent loop's conversation.
const CTX: &str = "4096";

fn require(module: &str) {
    let has = Command::new("python3").args(["-c", &format!("import {module}")]).status().is_ok_and(|s| s.success());
    assert!(has, "the `{module}` Python package is missing: run scripts/setup.sh (or python3 -m pip install {module})");
}

fn run_script(script: &str, addr: &str, key: &str, extra: &[&str]) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("clients").join(script);
    let out = Command::new("python3").arg(path).arg(format!("http://{addr}")).arg(key).args(extra).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{script} failed\nstdout:\n{stdout}\nstderr:\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("all checks passed"), "{stdout}");
    eprintln!("{}", stdout.trim());
}

#[test]
fn the_anthropic_sdk_works_unchanged_on_a_single_node() {
    require("anthropic");
    let server = Served::start(&["--threads", "2", "--ctx-size", CTX, "--parallel", "2", "--api-key", "test-key"]);
    run_script("anthropic_sdk.py", &server.addr, "test-key", &[]);
}

#[test]
fn the_ollama_client_works_unchanged_on_a_single_node() {
    require("ollama");
    let server = Served::start(&["--threads", "2", "--ctx-size", CTX, "--parallel", "2", "--api-key", "test-key"]);
    run_script("ollama_sdk.py", &server.addr, "test-key", &[]);
}

#[test]
fn the_openai_sdk_drives_the_responses_api_on_a_single_node() {
    require("openai");
    let server = Served::start(&["--threads", "2", "--ctx-size", CTX, "--parallel", "2", "--api-key", "test-key"]);
    run_script("openai_responses.py", &server.addr, "test-key", &[]);
}

#[test]
fn the_openai_and_ollama_clients_embed_on_a_single_node() {
    require("openai");
    require("ollama");
    let model = common::tiny_embedding_model("bert");
    let server = Served::start(&["--threads", "2", "--ctx-size", "1024", "--parallel", "2", "--api-key", "test-key", "--embedding-model", model.to_str().unwrap()]);
    run_script("embeddings_sdk.py", &server.addr, "test-key", &[]);
}

#[test]
fn the_client_sdks_work_through_a_three_member_ring() {
    require("anthropic");
    require("ollama");
    require("openai");
    let w1 = Served::worker(&["--threads", "1"]);
    let w2 = Served::worker(&["--threads", "1"]);
    let workers = format!("{},{}", w1.addr, w2.addr);
    // The embedding model runs on the head beside the ring's chat model.
    let embedder = common::tiny_embedding_model("nomic-bert");
    let head = Served::start(&["--threads", "1", "--ctx-size", CTX, "--parallel", "2", "--api-key", "ring-key", "--workers", &workers, "--windows", "10,10,10", "--embedding-model", embedder.to_str().unwrap()]);
    // A shorter agent loop: the ring's answers equal the single node's (tests/ring.rs), so
    // this checks that every answer still parses, not the loop's length.
    run_script("anthropic_sdk.py", &head.addr, "ring-key", &["3"]);
    run_script("ollama_sdk.py", &head.addr, "ring-key", &["3"]);
    run_script("openai_responses.py", &head.addr, "ring-key", &["3"]);
    run_script("embeddings_sdk.py", &head.addr, "ring-key", &[]);
}
