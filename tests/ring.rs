//! The ring as real processes on loopback: a head and two workers give the single
//! node's greedy output for every window shape, architecture and weight type, up to a
//! full context; a wrong secret is refused.

mod common;

use std::time::{Duration, Instant};

use common::Served;
use serde_json::Value;

const PROMPT: &str = "Explain in detail how a bicycle works.";
const TOKENS: usize = 48;

fn chat(addr: &str, stream: bool) -> String {
    let body = format!(r#"{{"model":"","messages":[{{"role":"user","content":"{PROMPT}"}}],"max_tokens":{TOKENS},"temperature":0,"stream":{stream}}}"#);
    let (status, body) = raw(addr, "POST /v1/chat/completions", &body);
    assert_eq!(status, 200, "{body}");
    common::chat_content(&body, stream)
}

#[test]
fn the_ring_gives_the_single_node_output_for_every_window_shape() {
    let single = Served::start(&["--threads", "1", "--parallel", "2"]);
    let expected = chat(&single.addr, false);
    drop(single);
    let w1 = Served::worker(&["--threads", "1"]);
    let w2 = Served::worker(&["--threads", "1"]);
    let workers = format!("{},{}", w1.addr, w2.addr);
    // k = 1, 2, 3, uneven, a head that only embeds, samples and relays, a relaying worker.
    for windows in ["10,10,10", "5,5,5", "4,3,3", "6,12,12", "0,15,15", "15,0,15"] {
        let head = Served::start(&["--threads", "1", "--parallel", "2", "--workers", &workers, "--windows", windows]);
        assert_eq!(chat(&head.addr, false), expected, "windows {windows}");
        assert_eq!(chat(&head.addr, true), expected, "windows {windows}, streamed");
    }
    // f16 activations halve the bytes per hop; report how far they agree.
    let head = Served::start(&["--threads", "1", "--workers", &workers, "--windows", "4,3,3", "--f16-activations"]);
    // Without --ctx-size the ring sizes the context to its devices' memory, as one node does.
    head.wait_logged("the ring's context said at start", std::time::Duration::from_secs(5), |l| l.contains("context per sequence: 8192 tokens (the model's own context"));
    let f16 = chat(&head.addr, false);
    let same = f16.chars().zip(expected.chars()).take_while(|(a, b)| a == b).count();
    eprintln!("f16 activations: first {same} of {} characters identical to f32", expected.chars().count());
    assert!(same > 0, "f16 output diverged at once: {f16:?}");
}

/// The new architectures through a ring of real processes: a tiny random qwen3moe,
/// gemma3 (sliding window of 8 tokens, shorter than the prompt), gpt-oss (sinks, MXFP4
/// experts), glm4moe (a dense first layer, a shared expert, partial RoPE) and llama4
/// (a NoPE layer, experts every second layer with a shared expert) and gemma4 (its own head
/// sizes and KV heads per layer kind, V from K, a dense FFN beside the experts) and
/// gemma4-e (E2B/E4B's per-layer inputs and layers sharing earlier layers' K/V) and
/// deepseek2 (latent attention: one compressed cache row per token) and qwen35moe
/// (linear-attention layers keeping a recurrent state per sequence, each member its own
/// windows', restored from checkpoints when a prompt is reused) of 6 layers
/// give the single node's greedy text for windows cut through every stage, with disjoint
/// windows per member, and with a relaying head; one worker has no model file and fetches
/// its windows from the head. Also a prompt of real text over 1,000 tokens, pipelined in
/// chunks (so sliding windows start past the first 256 cells).
///
/// Chunks round as micro-batches of their size do (llama.cpp's `n_ubatch`: see the engine's
/// `a_prompt_in_chunks_matches_llama_cpp_in_micro_batches_of_that_size`), and these random
/// models' answers change with it: the ring's chunk is pinned to the single node's batch.
/// With batch-invariant kernels the planned chunk gives the single node's answer too.
#[test]
fn moe_and_sliding_window_models_give_the_single_node_output_through_the_ring() {
    const CHUNK: &str = "50";
    let dir = std::env::temp_dir().join(format!("hearth-ring-archs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for arch in ["qwen3moe", "gemma3", "gpt-oss", "glm4moe", "llama4", "gemma4", "gemma4-e", "deepseek2", "qwen35moe"] {
        let mut m = engine::random_model::RandomModel::new(arch.trim_end_matches("-e"), 6, 64, 128, 4, 2);
        m.n_ff_exp = 64;
        m.n_swa = 8;
        m.seed = 7;
        if arch == "gemma4-e" {
            // E2B/E4B's block: per-layer inputs, and layers 3-5 attending with layer 1's
            // and 2's K/V, which members holding 3-5 but not 1-2 receive with the hidden
            // states.
            (m.n_expert, m.n_expert_used, m.full_every, m.per_layer_embd, m.shared_kv_layers) = (0, 0, 3, 32, 3);
        }
        let path = dir.join(format!("{arch}.gguf"));
        m.write(&common::default_model(), &path).unwrap();
        let single = Served::start_model(&path, &["--threads", "1", "--ctx-size", "2048", "--max-batch", CHUNK]);
        let expected = chat(&single.addr, false);
        let expected_long = common::complete_long(&single.addr);
        drop(single);
        assert!(!expected.is_empty(), "{arch}: empty answer");
        let model = path.to_str().unwrap();
        let shipped = dir.join(format!("shipped-{arch}"));
        let w1 = Served::worker_at("127.0.0.1:0", &path, &["--threads", "1"]).unwrap();
        let w2 = Served::worker_fetching(&["--threads", "1", "--model-dir", shipped.to_str().unwrap()]);
        let workers = format!("{},{}", w1.addr, w2.addr);
        let ring = ["--threads", "1", "--ctx-size", "2048", "--workers", &workers, "--max-batch", CHUNK, "--prompt-chunk", CHUNK];
        for windows in ["2,2,2", "1,1,1", "0,3,3"] {
            let head = Served::start_model(&path, &[&ring[..], &["--windows", windows]].concat());
            assert_eq!(chat(&head.addr, false), expected, "{arch} ({model}), windows {windows}");
            assert_eq!(chat(&head.addr, true), expected, "{arch}, windows {windows}, streamed");
            assert_eq!(common::complete_long(&head.addr), expected_long, "{arch}, windows {windows}, a prompt of over 1,000 tokens");
        }
        // Every device paging its windows from disk (released after each use): MoE layers
        // then read only the experts each router chose, while the graph runs.
        let head = Served::start_model(&path, &[&ring[..], &["--windows", "1,1,1", "--release-windows"]].concat());
        assert_eq!(chat(&head.addr, false), expected, "{arch}, paged windows");
        assert_eq!(common::complete_long(&head.addr), expected_long, "{arch}, paged windows, a prompt of over 1,000 tokens");
        drop(head);
        // Chunks as the plan cuts them, batch-invariant kernels on both sides.
        let single = Served::start_model(&path, &["--threads", "1", "--ctx-size", "2048", "--batch-invariant"]);
        let invariant_long = common::complete_long(&single.addr);
        drop(single);
        let head = Served::start_model(&path, &["--threads", "1", "--ctx-size", "2048", "--workers", &workers, "--windows", "2,2,2", "--batch-invariant"]);
        assert_eq!(common::complete_long(&head.addr), invariant_long, "{arch}, planned chunks, batch-invariant kernels");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A prompt of real text that nearly fills a context of `CTX_NEAR_FULL` cells, answered
/// until the context is full: (text, finish reason, completion tokens).
fn fill_the_context(addr: &str) -> (String, String, u64) {
    let v = common::complete_real_text(addr, 3000, CTX_NEAR_FULL);
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 1000 && prompt_tokens + 16 < CTX_NEAR_FULL as u64, "{}", v["usage"]);
    let choice = &v["choices"][0];
    (choice["text"].as_str().unwrap().to_string(), choice["finish_reason"].as_str().unwrap().to_string(), v["usage"]["completion_tokens"].as_u64().unwrap())
}

/// A greedy chat with a logit bias (end-of-text and end-of-turn suppressed, one token
/// lifted): the head's sampler merges biased tokens into its top candidates.
fn biased_chat(addr: &str) -> String {
    let body = format!(r#"{{"model":"","messages":[{{"role":"user","content":"{PROMPT}"}}],"max_tokens":{TOKENS},"temperature":0,"logit_bias":{{"0":-100,"2":-100,"30":4}}}}"#);
    let (status, body) = raw(addr, "POST /v1/chat/completions", &body);
    assert_eq!(status, 200, "{body}");
    common::chat_content(&body, false)
}

/// Context of the near-full test: a little over its prompt of 3,000 characters.
const CTX_NEAR_FULL: usize = 1280;

/// Weight types other than the default model's through the ring: the default model
/// requantized by `hearth quantize` to Q8_0 (whose odd row counts hearth pads) and to
/// Q5_K_M (K-quants, two block types in one file), served by a head and two workers
/// holding that file, give the single node's answer for a short chat (plain, streamed
/// and with a logit bias) and for a prompt of over 1,000 tokens answered until the context is full.
/// Prompt chunks are pinned to the single node's batch (the rounding of a prompt's rows
/// depends on the micro-batch it is computed in).
#[test]
fn other_weight_types_give_the_single_node_output_through_the_ring_up_to_a_full_context() {
    const CHUNK: &str = "64";
    let ctx = CTX_NEAR_FULL.to_string();
    let dir = std::env::temp_dir().join(format!("hearth-ring-types-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for ty in ["q8_0", "q5_k_m"] {
        let path = dir.join(format!("default-{ty}.gguf"));
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_hearth-under-test"))
            .args(["quantize", common::default_model().to_str().unwrap(), path.to_str().unwrap(), "--type", ty])
            .output()
            .unwrap();
        assert!(out.status.success(), "hearth quantize --type {ty}: {}", String::from_utf8_lossy(&out.stderr));
        let single = Served::start_model(&path, &["--threads", "1", "--ctx-size", &ctx, "--max-batch", CHUNK]);
        let (short, biased, full) = (chat(&single.addr, false), biased_chat(&single.addr), fill_the_context(&single.addr));
        drop(single);
        assert_eq!(full.1, "length", "{ty}: the answer ends when the context is full");
        let w1 = Served::worker_at("127.0.0.1:0", &path, &["--threads", "1"]).unwrap();
        let w2 = Served::worker_at("127.0.0.1:0", &path, &["--threads", "1"]).unwrap();
        let workers = format!("{},{}", w1.addr, w2.addr);
        for windows in ["10,10,10", "4,3,3"] {
            let head = Served::start_model(&path, &["--threads", "1", "--ctx-size", &ctx, "--workers", &workers, "--windows", windows, "--max-batch", CHUNK, "--prompt-chunk", CHUNK]);
            assert_eq!(chat(&head.addr, false), short, "{ty}, windows {windows}");
            assert_eq!(chat(&head.addr, true), short, "{ty}, windows {windows}, streamed");
            assert_eq!(biased_chat(&head.addr), biased, "{ty}, windows {windows}, with a logit bias");
            assert_eq!(fill_the_context(&head.addr), full, "{ty}, windows {windows}, a prompt answered until the context is full");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A split model (`hearth quantize --split-max-size`, llama.cpp's gguf-split layout, three
/// parts or more) served by a head whose workers are one with its own copy of the split set and
/// one with no model, which fetches its windows from the head part by part: the ring
/// gives what the single node gives on the model in one file, for windows cut across the
/// parts' boundaries, and up to a full context.
#[test]
fn a_split_model_through_the_ring_with_a_worker_fetching_its_windows_gives_the_single_file_output() {
    const CHUNK: &str = "64";
    let ctx = CTX_NEAR_FULL.to_string();
    let dir = std::env::temp_dir().join(format!("hearth-ring-split-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = common::default_model();
    let third = std::fs::metadata(&model).unwrap().len() / 3 + 1;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_hearth-under-test"))
        .args(["quantize", model.to_str().unwrap(), dir.join("split.gguf").to_str().unwrap(), "--split-max-size", &third.to_string()])
        .output()
        .unwrap();
    assert!(out.status.success(), "hearth quantize --split-max-size: {}", String::from_utf8_lossy(&out.stderr));
    let printed = String::from_utf8_lossy(&out.stdout);
    let parts = printed.lines().count() as u64;
    let first = dir.join(engine::gguf::split::part_name("split", 1, parts));
    assert!(parts >= 3 && first.is_file(), "three parts or more expected: {printed}");

    let single = Served::start(&["--threads", "1", "--ctx-size", &ctx, "--max-batch", CHUNK]);
    let (short, full) = (chat(&single.addr, false), fill_the_context(&single.addr));
    drop(single);
    let w1 = Served::worker_at("127.0.0.1:0", &first, &["--threads", "1"]).unwrap();
    let shipped = dir.join("shipped");
    let w2 = Served::worker_fetching(&["--threads", "1", "--model-dir", shipped.to_str().unwrap()]);
    let workers = format!("{},{}", w1.addr, w2.addr);
    for windows in ["10,10,10", "4,13,13"] {
        let head = Served::start_model(&first, &["--threads", "1", "--ctx-size", &ctx, "--workers", &workers, "--windows", windows, "--max-batch", CHUNK, "--prompt-chunk", CHUNK]);
        assert_eq!(chat(&head.addr, false), short, "windows {windows}");
        assert_eq!(chat(&head.addr, true), short, "windows {windows}, streamed");
        if windows == "4,13,13" {
            assert_eq!(fill_the_context(&head.addr), full, "windows {windows}, a prompt answered until the context is full");
            assert!(metric(&head.addr, "hearth_model_bytes_served_total") > 0.0, "the worker without the model fetched it from the head");
        }
    }
    // The worker's copy: the head's parts.
    let copies: Vec<String> = std::fs::read_dir(&shipped).unwrap().flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.ends_with(".gguf")).collect();
    assert_eq!(copies.len() as u64, parts, "{copies:?}");
    assert!(copies.iter().all(|n| n.ends_with(&format!("-of-{parts:05}.gguf"))), "{copies:?}");
    std::fs::remove_dir_all(&dir).ok();
}

/// `--ctx-size` past the model's trained context (a random model trained for 256 cells,
/// served with 512): each sequence gets the model's 256, on the single node and through
/// the ring alike, and a prompt answered past them ends with `length` where the single
/// node ends it. Found by the journey (scripts/journey.sh): the ring's head admitted
/// what --ctx-size allowed while its stages held the model's context, and a 4,196-token
/// prompt failed mid-answer with a server error at cell 4,096.
#[test]
fn a_ctx_size_past_the_models_context_ends_the_answer_where_the_single_node_does() {
    let dir = std::env::temp_dir().join(format!("hearth-ring-ctx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut m = engine::random_model::RandomModel::new("llama", 6, 64, 128, 4, 2);
    m.context_length = 256;
    m.seed = 3;
    let path = dir.join("ctx256.gguf");
    m.write(&common::default_model(), &path).unwrap();
    let answer = |addr: &str| {
        let v = common::complete_real_text(addr, 800, 200);
        let (prompt, completion) = (v["usage"]["prompt_tokens"].as_u64().unwrap(), v["usage"]["completion_tokens"].as_u64().unwrap());
        (v["choices"][0]["text"].as_str().unwrap().to_string(), v["choices"][0]["finish_reason"].as_str().unwrap().to_string(), prompt, completion)
    };
    let args = ["--threads", "1", "--ctx-size", "512", "--max-batch", "64"];
    let single = Served::start_model(&path, &args);
    let expected = answer(&single.addr);
    drop(single);
    assert_eq!(expected.1, "length", "{expected:?}");
    assert!(expected.2 + expected.3 <= 256 && expected.2 + 200 > 256, "the answer stops at the model's 256 cells: {expected:?}");
    let w1 = Served::worker_at("127.0.0.1:0", &path, &["--threads", "1"]).unwrap();
    let w2 = Served::worker_at("127.0.0.1:0", &path, &["--threads", "1"]).unwrap();
    let workers = format!("{},{}", w1.addr, w2.addr);
    let head = Served::start_model(&path, &[&args[..], &["--workers", &workers, "--windows", "2,2,2", "--prompt-chunk", "64"]].concat());
    assert_eq!(answer(&head.addr), expected);
    std::fs::remove_dir_all(&dir).ok();
}

/// A quantized KV cache (`--cache-type-k q8_0 --cache-type-v q4_0`) set on the head
/// reaches every worker with the plan: the ring gives the single node's answer with the
/// same flags for a short chat and for a prompt of over 1,000 tokens answered until the
/// context is full, and each worker says which types it caches in.
#[test]
fn a_quantized_kv_cache_gives_the_single_node_output_through_the_ring_up_to_a_full_context() {
    const CHUNK: &str = "64";
    let ctx = CTX_NEAR_FULL.to_string();
    let kv = ["--cache-type-k", "q8_0", "--cache-type-v", "q4_0"];
    let single = Served::start(&[&["--threads", "1", "--ctx-size", &ctx, "--max-batch", CHUNK][..], &kv].concat());
    let (short, full) = (chat(&single.addr, false), fill_the_context(&single.addr));
    drop(single);
    assert_eq!(full.1, "length", "the answer ends when the context is full");
    let w1 = Served::worker(&["--threads", "1"]);
    let w2 = Served::worker(&["--threads", "1"]);
    let workers = format!("{},{}", w1.addr, w2.addr);
    let head = Served::start(&[&["--threads", "1", "--ctx-size", &ctx, "--workers", &workers, "--windows", "4,13,13", "--max-batch", CHUNK, "--prompt-chunk", CHUNK][..], &kv].concat());
    assert_eq!(chat(&head.addr, false), short);
    assert_eq!(fill_the_context(&head.addr), full, "a prompt answered until the context is full");
    for w in [&w1, &w2] {
        w.wait_logged("a worker caching in the head's types", Duration::from_secs(10), |l| l.contains("plan loaded") && l.contains("K q8_0, V q4_0"));
    }
}

#[test]
fn two_concurrent_streams_across_the_ring() {
    let w1 = Served::worker(&["--threads", "1"]);
    let w2 = Served::worker(&["--threads", "1"]);
    // Batch-invariant kernels: with llama.cpp's own, a sequence decoded beside another
    // rounds differently from the same sequence alone (docs/speculation.md).
    let head = Served::start(&["--threads", "1", "--parallel", "2", "--batch-invariant", "--workers", &format!("{},{}", w1.addr, w2.addr), "--plan-strategy", "even"]);
    let alone = chat(&head.addr, true);
    let addr = head.addr.clone();
    let other = std::thread::spawn(move || chat(&addr, true));
    let mine = chat(&head.addr, true);
    assert_eq!(mine, alone);
    assert_eq!(other.join().unwrap(), alone);
}

#[test]
fn a_wrong_cluster_secret_is_refused() {
    let w = Served::worker(&["--threads", "1", "--cluster-secret", "right-secret"]);
    let err = match Served::try_start(&["--threads", "1", "--workers", &w.addr, "--cluster-secret", "wrong-secret"]) {
        Ok(_) => panic!("a head with the wrong secret formed a ring"),
        Err(log) => log,
    };
    assert!(err.contains(&w.addr), "the error should name the worker: {err}");
}

fn raw(addr: &str, method_path: &str, body: &str) -> (u16, String) {
    raw_with(addr, method_path, "", body)
}

/// `headers`: extra header lines, each ending in `\r\n`.
fn raw_with(addr: &str, method_path: &str, headers: &str, body: &str) -> (u16, String) {
    let (method, path) = method_path.split_once(' ').unwrap();
    let r = common::http(addr, method, path, headers, body).unwrap();
    (r.status, r.body)
}

/// A stream that runs its 900 tokens whatever the host's speed: the end-of-text tokens
/// are banned, so a fault injected mid-stream always finds it running.
const LONG: &str = r#"{"model":"","messages":[{"role":"user","content":"Write a very long story."}],"max_tokens":900,"temperature":0,"logit_bias":{"0":-100,"2":-100}}"#;

fn health(addr: &str) -> Value {
    let (status, body) = raw(addr, "GET /health", "");
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Polls /health until it says `ok`; panics with the last answer after `limit`.
fn wait_healthy(addr: &str, limit: Duration) {
    let start = Instant::now();
    loop {
        let h = health(addr);
        if h["status"] == "ok" {
            return;
        }
        assert!(start.elapsed() < limit, "the ring did not recover within {limit:?}: {h}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A counter or gauge of the head's /metrics (0 before it is first set).
fn metric(addr: &str, name: &str) -> f64 {
    let (_, text) = raw(addr, "GET /metrics", "");
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok()).unwrap_or(0.0)
}

/// Waits until the head has generated `n` more tokens than `before`: a request is then
/// mid-stream (a fixed pause would be too short on a busy machine, or past the end).
fn wait_generating(addr: &str, before: f64, n: f64) {
    common::wait_for("the request to be generating", Duration::from_secs(60), || (metric(addr, "hearth_generated_tokens_total") >= before + n).then_some(()));
}

/// Checks that a request fails with 503 `ring_unavailable` whose message contains `names`.
fn assert_ring_unavailable(status: u16, body: &str, names: &str) {
    assert_eq!(status, 503, "{body}");
    let v: Value = serde_json::from_str(body).unwrap();
    assert_eq!(v["error"]["code"], "ring_unavailable", "{body}");
    assert!(v["error"]["message"].as_str().unwrap().contains(names), "the error should name {names}: {body}");
}

/// A copy of the default model with one weight byte changed: same shape, other content.
fn different_model(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("other.gguf");
    std::fs::copy(common::default_model(), &path).unwrap();
    let g = engine::gguf::GgufFile::open(&path).unwrap();
    let at = g.data_offset() + g.meta().tensors()[0].offset;
    drop(g);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[at as usize] ^= 0x5a;
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn a_worker_killed_mid_stream_ends_it_with_an_error_then_503_until_it_returns_with_another_file_fetches_the_heads_and_serving_resumes() {
    let w1 = Served::worker(&["--threads", "1"]);
    let mut w2 = Served::worker(&["--threads", "1"]);
    let w2_addr = w2.addr.clone();
    let head = Served::start(&["--threads", "1", "--workers", &format!("{},{}", w1.addr, w2.addr), "--plan-strategy", "even"]);
    let expected = chat(&head.addr, false);

    // kill -9 mid-stream: the stream in flight ends with a ring_unavailable error event.
    let addr = head.addr.clone();
    let streamed = LONG.replace(r#""temperature":0"#, r#""temperature":0,"stream":true"#);
    let before = metric(&head.addr, "hearth_generated_tokens_total");
    let pending = std::thread::spawn(move || raw(&addr, "POST /v1/chat/completions", &streamed));
    wait_generating(&head.addr, before, 8.0);
    w2.child.kill().unwrap(); // SIGKILL: no goodbye on the link
    let (status, body) = pending.join().unwrap();
    assert_eq!(status, 200, "{body}");
    let events: Vec<&str> = body.split("\n\n").filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: "))).collect();
    assert!(events.len() > 2, "the stream should have run before the kill: {body}");
    let error: Value = serde_json::from_str(events[events.len() - 2]).unwrap();
    assert_eq!(error["error"]["code"], "ring_unavailable", "{body}");
    assert_eq!(events[events.len() - 1], "[DONE]");

    // The head keeps answering /health, degraded, and refuses new requests at once.
    let h = health(&head.addr);
    assert_eq!(h["status"], "degraded", "{h}");
    // (That the refusal comes at submission, before any queueing, is the batcher's unit
    // test `a_lost_ring_member_degrades_the_head_until_it_recovers`.)
    let (status, body) = raw(&head.addr, "POST /v1/chat/completions", LONG);
    assert_ring_unavailable(status, &body, "");
    // Once the head has tried to re-form the ring, the reason names the lost worker.
    common::wait_for("the reason to name the lost worker", Duration::from_secs(30), || health(&head.addr)["reason"].as_str().is_some_and(|r| r.contains(&w2_addr)).then_some(()));

    // The worker comes back with another model file: it fetches the head's model (the
    // header and its windows) into its --model-dir, and the ring is whole again with the
    // head's model, output as before.
    let dir = std::env::temp_dir().join(format!("hearth-ring-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let shipped = dir.join("shipped");
    let _w2 = Served::worker_at(&w2_addr, &different_model(&dir), &["--threads", "1", "--model-dir", shipped.to_str().unwrap()]).unwrap();
    wait_healthy(&head.addr, Duration::from_secs(60));
    assert_eq!(chat(&head.addr, false), expected);
    assert_eq!(chat(&head.addr, true), expected);
    assert!(metric(&head.addr, "hearth_model_bytes_served_total") > 0.0, "the worker with another file fetched the head's");
    let _ = std::fs::remove_dir_all(&dir);
    let (_, metrics) = raw(&head.addr, "GET /metrics", "");
    for line in ["hearth_ring_up 1", "hearth_ring_breaks_total 1", "hearth_ring_recoveries_total 1"] {
        assert!(metrics.lines().any(|l| l == line), "missing {line:?} in\n{metrics}");
    }
    assert!(metrics.contains("hearth_ring_round_trip_seconds_count"), "{metrics}");
}

/// A worker's own model file written to while it serves (a same-size copy of a new
/// version over it): its next step is an error naming the file, not activations computed
/// from bytes that changed under the stage; when the head forms the ring again the worker
/// fetches the head's copy into its --model-dir and the output is the single node's again.
#[test]
fn a_workers_model_file_written_while_it_serves_ends_the_stream_and_the_worker_fetches_the_heads_copy() {
    let dir = std::env::temp_dir().join(format!("hearth-ring-rewritten-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let own = dir.join("own.gguf");
    std::fs::copy(common::default_model(), &own).unwrap();
    let shipped = dir.join("shipped");
    let w1 = Served::worker_at("127.0.0.1:0", &own, &["--threads", "1", "--model-dir", shipped.to_str().unwrap()]).unwrap();
    let w2 = Served::worker(&["--threads", "1"]);
    let head = Served::start(&["--threads", "1", "--workers", &format!("{},{}", w1.addr, w2.addr), "--plan-strategy", "even"]);
    let expected = chat(&head.addr, false);
    assert_eq!(metric(&head.addr, "hearth_model_bytes_served_total"), 0.0, "both workers had the head's file");

    let addr = head.addr.clone();
    let before = metric(&head.addr, "hearth_generated_tokens_total");
    let pending = std::thread::spawn(move || raw(&addr, "POST /v1/chat/completions", LONG));
    wait_generating(&head.addr, before, 8.0);
    // Same size, same bytes even: only the write itself tells the worker. (A byte in the
    // header, which no stage reads again; the check is on the file, not on the bytes.)
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().read(true).write(true).open(&own).unwrap();
        let mut byte = [0u8; 1];
        f.read_at(&mut byte, 0).unwrap();
        // Some filesystems keep mtime in whole seconds: a later second for sure.
        std::thread::sleep(Duration::from_millis(1100));
        f.write_at(&byte, 0).unwrap();
    }
    let (status, body) = pending.join().unwrap();
    assert_ring_unavailable(status, &body, "own.gguf");
    assert!(body.contains("written to"), "{body}");
    w1.wait_logged("the worker's reason", Duration::from_secs(10), |l| l.contains("own.gguf") && l.contains("written to"));
    wait_healthy(&head.addr, Duration::from_secs(60));
    assert_eq!(chat(&head.addr, false), expected);
    assert!(metric(&head.addr, "hearth_model_bytes_served_total") > 0.0, "the worker fetched the head's copy");
    drop((head, w1, w2));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_frozen_worker_breaks_the_ring_and_it_recovers_when_it_thaws() {
    let w1 = Served::worker(&["--threads", "1"]);
    let w2 = Served::worker(&["--threads", "1"]);
    let head = Served::start(&["--threads", "1", "--workers", &format!("{},{}", w1.addr, w2.addr), "--plan-strategy", "even"]);
    let expected = chat(&head.addr, false);
    let addr = head.addr.clone();
    let before = metric(&head.addr, "hearth_generated_tokens_total");
    let pending = std::thread::spawn(move || raw(&addr, "POST /v1/chat/completions", LONG));
    wait_generating(&head.addr, before, 8.0);
    // SIGSTOP: the process is alive, its sockets open, but it answers nothing.
    w1.signal(common::SIGSTOP);
    let started = Instant::now();
    let (status, body) = pending.join().unwrap();
    eprintln!("a frozen worker was noticed after {:?}", started.elapsed());
    assert_ring_unavailable(status, &body, "");
    assert_eq!(health(&head.addr)["status"], "degraded");
    w1.signal(common::SIGCONT);
    wait_healthy(&head.addr, Duration::from_secs(30));
    assert_eq!(chat(&head.addr, false), expected);
}

#[test]
fn a_second_head_is_refused_while_the_first_serves_and_takes_over_when_it_stops() {
    let w1 = Served::worker(&["--threads", "1"]);
    let w2 = Served::worker(&["--threads", "1"]);
    let workers = format!("{},{}", w1.addr, w2.addr);
    let first = Served::start(&["--threads", "1", "--workers", &workers, "--windows", "4,3,3"]);
    let expected = chat(&first.addr, false);
    let err = match Served::try_start(&["--threads", "1", "--workers", &workers, "--windows", "4,3,3"]) {
        Ok(_) => panic!("a second head took over workers that serve a running head"),
        Err(log) => log,
    };
    assert!(err.contains("another head"), "{err}");
    assert_eq!(chat(&first.addr, false), expected);
    // A head that is stopped (or restarted) frees its workers for the next one.
    drop(first);
    let second = Served::start(&["--threads", "1", "--workers", &workers, "--windows", "4,3,3"]);
    assert_eq!(chat(&second.addr, true), expected);
}

#[test]
fn a_head_started_before_its_workers_waits_for_them() {
    let free = || std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let (a1, a2) = (free(), free());
    let model = common::default_model();
    let (b1, b2) = (a1.clone(), a2.clone());
    // The workers come up a few seconds after the head, as compose files on two machines
    // might: a deliberate delay (the head shows nothing to wait for until its ring forms).
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(3));
        (Served::worker_at(&b1, &model, &["--threads", "1"]).unwrap(), Served::worker_at(&b2, &model, &["--threads", "1"]).unwrap())
    });
    let head = Served::start(&["--threads", "1", "--workers", &format!("{a1},{a2}"), "--ring-wait", "60", "--plan-strategy", "even"]);
    let _workers = late.join().unwrap();
    assert_eq!(health(&head.addr)["status"], "ok");
    assert!(!chat(&head.addr, false).is_empty());
}

#[test]
fn the_scheduler_plans_the_ring_from_the_devices_measured_profiles() {
    let single = Served::start(&["--threads", "1"]);
    let expected = chat(&single.addr, false);
    drop(single);
    let w1 = Served::worker(&["--threads", "1"]);
    let w2 = Served::worker(&["--threads", "1"]);
    let workers = format!("{},{}", w1.addr, w2.addr);
    // `even` keeps every worker (the profile RPC, the planning and the ring all run);
    // `halda` may keep fewer, even none on one machine: the answer must not change.
    for strategy in ["even", "halda"] {
        let head = Served::start(&["--threads", "1", "--workers", &workers, "--plan-strategy", strategy]);
        assert_eq!(chat(&head.addr, false), expected, "--plan-strategy {strategy}");
    }
    let bad = Served::try_start(&["--threads", "1", "--workers", &workers, "--plan-strategy", "fastest"]);
    assert!(bad.is_err_and(|log| log.contains("unknown plan strategy")));
}

/// An admin call with the key the test heads get; the answer must be 200 JSON.
fn admin(addr: &str, method_path: &str, body: &str) -> Value {
    let (status, text) = raw_with(addr, method_path, "Authorization: Bearer admin-key\r\n", body);
    assert_eq!(status, 200, "{method_path}: {text}");
    serde_json::from_str(&text).unwrap()
}

fn windows(plan: &Value) -> Vec<u64> {
    plan["members"].as_array().unwrap().iter().map(|m| m["window"].as_u64().unwrap()).collect()
}

#[test]
fn the_admin_api_shows_the_plan_and_replans_on_demand_without_changing_the_answer() {
    let single = Served::start(&["--threads", "1"]);
    let expected = chat(&single.addr, false);
    // Off without --admin-key; a single node's plan is the head alone.
    let (status, body) = raw(&single.addr, "GET /admin/plan", "");
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("admin_disabled"), "{body}");
    drop(single);

    let w1 = Served::worker(&["--threads", "1"]);
    let w2 = Served::worker(&["--threads", "1"]);
    let workers = format!("{},{}", w1.addr, w2.addr);
    let head = Served::start(&["--threads", "1", "--workers", &workers, "--plan-strategy", "even", "--admin-key", "admin-key"]);
    let (status, body) = raw_with(&head.addr, "GET /admin/plan", "Authorization: Bearer wrong\r\n", "");
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("invalid_admin_key"), "{body}");

    let plan = admin(&head.addr, "GET /admin/plan", "");
    assert_eq!(plan["source"], "even", "{plan}");
    assert_eq!(windows(&plan), vec![10, 10, 10], "{plan}");
    assert_eq!(plan["members"][1]["layers"], serde_json::json!([[10, 20]]), "{plan}");
    assert!(plan["predicted_tpot_ms"].as_f64().unwrap() > 0.0, "{plan}");
    assert_eq!(plan["replans"], 0);
    let cluster = admin(&head.addr, "GET /admin/cluster", "");
    let devices = cluster["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 3, "{cluster}");
    assert_eq!(devices[0]["name"], "head");
    assert_eq!(devices[1]["name"], w1.addr.as_str());
    assert!(devices[1]["comm_s"].as_f64().unwrap() > 0.0, "the hop latency is measured: {cluster}");
    assert!(devices[2]["ram_available"].as_f64().unwrap() > 0.0, "{cluster}");

    assert_eq!(chat(&head.addr, false), expected);
    let plan = admin(&head.addr, "GET /admin/plan", "");
    assert!(plan["measured_steps"].as_u64().unwrap() > 0 && plan["measured_tpot_ms"].as_f64().unwrap() > 0.0, "{plan}");
    // The hop the ring's traffic measured: positive, below a whole step, and the prediction
    // at the measured context is made with it.
    let (hop, tpot) = (plan["measured_hop_ms"].as_f64().unwrap(), plan["measured_tpot_ms"].as_f64().unwrap());
    assert!(hop > 0.0 && hop < tpot, "{plan}");
    assert!(plan["predicted_tpot_ms_at_measured_context"].as_f64().unwrap() > 0.0, "{plan}");

    // Bad requests are refused with the reason.
    let (status, body) = raw_with(&head.addr, "POST /admin/replan", "Authorization: Bearer admin-key\r\n", r#"{"strategy":"fastest"}"#);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("unknown plan strategy"), "{body}");
    let (status, body) = raw_with(&head.addr, "POST /admin/replan", "Authorization: Bearer admin-key\r\n", "{not json");
    assert_eq!(status, 400, "{body}");

    // Halda on one machine: the plan changes (extra hops buy nothing here), the answer does not.
    let halda = admin(&head.addr, "POST /admin/replan", r#"{"strategy":"halda"}"#);
    assert_eq!(halda["source"], "halda", "{halda}");
    assert_eq!(halda["replans"], 1, "{halda}");
    assert!(halda["last_check"]["applied"].as_bool().unwrap(), "{halda}");
    assert!(windows(&halda) != vec![10, 10, 10], "{halda}");
    assert_eq!(windows(&halda).iter().sum::<u64>() * halda["rounds"].as_u64().unwrap(), 30, "{halda}");
    assert_eq!(chat(&head.addr, false), expected, "after re-planning to {halda}");
    assert_eq!(chat(&head.addr, true), expected);

    // Back to every worker: the ring forms again with both and still answers the same.
    let even = admin(&head.addr, "POST /admin/replan", r#"{"strategy":"even"}"#);
    assert_eq!(windows(&even), vec![10, 10, 10], "{even}");
    assert_eq!(even["replans"], 2);
    assert_eq!(chat(&head.addr, false), expected);

    // Asking for the running plan again (the running strategy, `even`, whose plan does not
    // depend on measured speeds): nothing changes, and the answer says why.
    let again = admin(&head.addr, "POST /admin/replan", "");
    assert_eq!(again["replans"], 2, "{again}");
    assert!(!again["last_check"]["applied"].as_bool().unwrap(), "{again}");
    assert!(again["last_check"]["reason"].as_str().unwrap().contains("running plan again"), "{again}");
    let (_, metrics) = raw(&head.addr, "GET /metrics", "");
    for needle in ["hearth_replans_total 2", "hearth_plan_rounds 1", "hearth_device_layers{device=\"head\"} 10"] {
        assert!(metrics.lines().any(|l| l == needle), "missing {needle:?} in\n{metrics}");
    }
    assert!(metrics.lines().any(|l| l.starts_with("hearth_plan_predicted_tpot_seconds ")), "{metrics}");
    assert!(metrics.lines().any(|l| l.starts_with("hearth_plan_measured_tpot_seconds ")), "{metrics}");
}

#[test]
fn an_idle_head_looks_at_the_cluster_again_and_keeps_a_plan_that_still_holds() {
    let w1 = Served::worker(&["--threads", "1"]);
    let w2 = Served::worker(&["--threads", "1"]);
    let workers = format!("{},{}", w1.addr, w2.addr);
    let head = Served::start(&["--threads", "1", "--workers", &workers, "--plan-strategy", "even", "--replan-idle", "1", "--admin-key", "admin-key"]);
    let plan = admin(&head.addr, "GET /admin/plan", "");
    assert_eq!(plan["automatic"], true, "{plan}");
    // Idle for more than a second: the head gathers the profiles again by itself.
    let started = Instant::now();
    let check = loop {
        let plan = admin(&head.addr, "GET /admin/plan", "");
        if !plan["last_check"].is_null() {
            break plan;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "no idle check within 30 s: {plan}");
        std::thread::sleep(Duration::from_millis(200));
    };
    let last = &check["last_check"];
    assert_eq!(last["forced"], false, "{check}");
    // Whether or not this busy machine's free memory moved, `even` gives the same plan.
    assert_eq!(last["applied"], false, "{check}");
    assert_eq!(check["replans"], 0, "{check}");
    assert_eq!(windows(&check), vec![10, 10, 10]);
    let cluster = admin(&head.addr, "GET /admin/cluster", "");
    assert!(cluster["gathered_at"].as_u64().unwrap() >= last["at"].as_u64().unwrap(), "{cluster}");
    assert!(!chat(&head.addr, false).is_empty());
}

#[test]
fn a_worker_the_plan_leaves_out_may_vanish_without_stopping_re_planning() {
    let w1 = Served::worker(&["--threads", "1"]);
    let w2 = Served::worker(&["--threads", "1"]);
    let workers = format!("{},{}", w1.addr, w2.addr);
    // Halda (the default) on one machine, planning for one stream: extra hops buy nothing,
    // so it leaves a worker out (the head runs alone, or relays to one worker when the
    // measured profiles make the head look slower on this busy machine). For several
    // streams it may keep them: their micro-batches would overlap.
    let head = Served::start(&["--threads", "1", "--parallel", "1", "--workers", &workers, "--admin-key", "admin-key"]);
    let plan = admin(&head.addr, "GET /admin/plan", "");
    assert_eq!(plan["source"], "halda", "{plan}");
    let dropped: Vec<&str> = plan["dropped"].as_array().unwrap().iter().map(|d| d.as_str().unwrap()).collect();
    let (mut gone, kept) = match (dropped.contains(&w1.addr.as_str()), dropped.contains(&w2.addr.as_str())) {
        (_, true) => (w2, w1),
        (true, false) => (w1, w2),
        _ => panic!("the plan uses both workers: {plan}"),
    };
    let expected = chat(&head.addr, false);

    gone.child.kill().unwrap();
    let _ = gone.child.wait();
    let again = admin(&head.addr, "POST /admin/replan", "");
    assert!(again["last_check"]["drift"].as_array().unwrap().iter().any(|d| d.as_str().unwrap().contains("gone")), "{again}");
    let cluster = admin(&head.addr, "GET /admin/cluster", "");
    assert_eq!(cluster["devices"].as_array().unwrap().len(), 2, "{cluster}");
    // The ring can still be re-formed with the worker that is left.
    let even = admin(&head.addr, "POST /admin/replan", r#"{"strategy":"even"}"#);
    assert_eq!(windows(&even), vec![15, 15], "{even}");
    assert_eq!(even["members"][1]["name"], kept.addr.as_str());
    assert_eq!(chat(&head.addr, false), expected);
}

#[test]
fn a_head_listening_on_every_interface_finds_or_is_told_the_address_to_dial() {
    let w1 = Served::worker(&["--threads", "1", "--cluster-secret", "s3cret"]);
    let w2 = Served::worker(&["--threads", "1", "--cluster-secret", "s3cret"]);
    let workers = format!("{},{}", w1.addr, w2.addr);
    let base = ["--threads", "1", "--cluster-secret", "s3cret", "--workers", workers.as_str(), "--windows", "10,10,10"];
    // 0.0.0.0 is no address to dial: the head tells the last worker its address on the
    // route to that worker.
    let head = Served::start(&[&base[..], &["--ring-listen", "0.0.0.0:0"]].concat());
    assert!(!chat(&head.addr, false).is_empty());
    drop(head);
    // As in a container: bound to every interface, the last worker told another address.
    let port = common::free_port();
    let (listen, advertise) = (format!("0.0.0.0:{port}"), format!("127.0.0.1:{port}"));
    let head = Served::start(&[&base[..], &["--ring-listen", &listen, "--ring-advertise", &advertise]].concat());
    assert!(!chat(&head.addr, false).is_empty());
}

#[test]
fn a_worker_stops_at_once_on_sigterm() {
    // `docker stop` sends SIGTERM to the container's first process, which has no default
    // action for it: the worker must handle it itself.
    let mut w = Served::worker(&["--threads", "1"]);
    w.terminate();
    // "At once" is against the 10 s a container engine waits before it kills: the bound
    // only leaves room for a slow host.
    let status = common::wait_for("the worker to exit on SIGTERM", Duration::from_secs(30), || w.child.try_wait().unwrap());
    assert!(status.success(), "{status}");
}

#[test]
fn an_idle_head_notices_a_lost_worker_without_a_request() {
    let w1 = Served::worker(&["--threads", "1"]);
    let mut w2 = Served::worker(&["--threads", "1"]);
    let head = Served::start(&["--threads", "1", "--workers", &format!("{},{}", w1.addr, w2.addr), "--windows", "10,10,10"]);
    assert!(!chat(&head.addr, false).is_empty());
    assert_eq!(health(&head.addr)["status"], "ok");
    w2.child.kill().unwrap();
    let h = common::wait_for("/health to say degraded, with no request", Duration::from_secs(30), || Some(health(&head.addr)).filter(|h| h["status"] == "degraded"));
    // Named by its address, not the port its link back to the head came from.
    assert!(h["reason"].as_str().unwrap().contains(&w2.addr), "{h}");
}

/// Three members on this one machine, two threads each, default flags: the head knows they
/// share it (one host id in every profile), and the plan never keeps more threads busy at
/// once than the machine has cores (six spinning threads on two cores decoded 8 streams at
/// a quarter of one micro-batch at a time), nor a depth its forecast says loses to one
/// micro-batch at a time. Then it answers as the single node does.
#[test]
fn members_on_one_machine_never_keep_more_threads_busy_than_its_cores() {
    const THREADS: u64 = 2;
    let single = Served::start(&["--threads", "2"]);
    let expected = chat(&single.addr, false);
    drop(single);
    let w1 = Served::worker(&["--threads", "2"]);
    let w2 = Served::worker(&["--threads", "2"]);
    let workers = format!("{},{}", w1.addr, w2.addr);
    let head = Served::start(&["--threads", "2", "--parallel", "8", "--workers", &workers, "--admin-key", "admin-key"]);
    let cluster = admin(&head.addr, "GET /admin/cluster", "");
    let hosts: Vec<&Value> = cluster["devices"].as_array().unwrap().iter().map(|d| &d["host"]).collect();
    let id = hosts[0]["id"].as_str().unwrap();
    assert!(!id.is_empty() && hosts.iter().all(|h| h["id"] == id && h["threads"] == THREADS), "{cluster}");
    let cores = hosts[0]["cores"].as_f64().unwrap();
    assert!(cores >= 1.0, "{cluster}");
    // The machine's RAM is counted once: members without memory limits of their own share
    // it (equal threads, equal shares), so together they plan at most what it holds.
    if hosts.iter().all(|h| h["own_memory"] == false) {
        let ram: Vec<f64> = cluster["devices"].as_array().unwrap().iter().map(|d| d["ram_available"].as_f64().unwrap()).collect();
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
        let total = meminfo.lines().find_map(|l| l.strip_prefix("MemTotal:")).and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok()).unwrap() * 1024.0;
        assert!(ram.iter().all(|&r| r > 0.0 && (r - ram[0]).abs() <= 1.0), "{ram:?}");
        assert!(ram.iter().sum::<f64>() <= total, "{ram:?} of {total} bytes");
    }

    let plan = admin(&head.addr, "GET /admin/plan", "");
    let depth = plan["micro_batches"].as_u64().unwrap();
    let members = plan["members"].as_array().unwrap();
    let threads: Vec<u64> = members.iter().filter(|m| m["window"].as_u64().unwrap() > 0 || m["name"] == "head").map(|m| m["threads"].as_u64().unwrap_or(THREADS)).collect();
    if depth > 1 {
        // Those that may compute at once keep at most the cores busy (one thread each at
        // the least: a lone thread never spins at a barrier).
        let at_once = (depth as usize).min(threads.len());
        let mut busiest = threads.clone();
        busiest.sort_unstable_by(|a, b| b.cmp(a));
        let busy: u64 = busiest[..at_once].iter().sum();
        assert!(busy as f64 <= cores.max(at_once as f64), "{busy} threads busy on {cores} cores: {plan}");
    }
    let eight = plan["forecast"]["streams"].as_array().unwrap().iter().find(|s| s["streams"] == 8).cloned().unwrap();
    let (pipelined, one) = (eight["pipelined_tokens_per_s"].as_f64().unwrap(), eight["one_at_a_time_tokens_per_s"].as_f64().unwrap());
    assert!(pipelined >= one / 1.02 * (1.0 - 1e-9), "the forecast picked a depth that loses to one at a time: {plan}");
    assert_eq!(chat(&head.addr, false), expected);
}
