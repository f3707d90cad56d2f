//! Models that keep a recurrent state per sequence (Qwen3.5's linear attention), served
//! as a user serves them: a conversation whose turns start from the state checkpointed
//! near the previous prompt's end gives the answers computed from scratch, on the single
//! node and through a ring of real processes (each member checkpointing its own windows'
//! state), and speculative decoding, whose rejected drafts take the state back to a
//! snapshot, gives the answers computed without it to requests decoding together.

mod common;

use std::path::{Path, PathBuf};

use common::Served;
use serde_json::{json, Value};

/// Turns of the conversation: a few sentences each, and the answers sent back.
const TURNS: usize = 20;
const CTX: &str = "4096";

/// A tiny Qwen3.5 MoE of 6 layers: recurrent layers 0, 2, 4, full attention 1, 3, 5.
fn model(dir: &Path) -> PathBuf {
    model_of(dir, 11, engine::gguf::GgmlType::F16)
}

/// The model of `seed` in weights of type `ty`.
fn model_of(dir: &Path, seed: u64, ty: engine::gguf::GgmlType) -> PathBuf {
    let mut m = engine::random_model::RandomModel::new("qwen35moe", 6, 64, 128, 4, 2);
    m.n_ff_exp = 64;
    m.seed = seed;
    m.ty = ty;
    let path = dir.join(format!("qwen35moe-{seed}-{ty:?}.gguf"));
    m.write(&common::default_model(), &path).unwrap();
    path
}

fn post(addr: &str, path: &str, body: &Value) -> Value {
    let r = common::http(addr, "POST", path, "", &body.to_string()).unwrap();
    assert_eq!(r.status, 200, "{path}: {}", r.body);
    serde_json::from_str(&r.body).unwrap()
}

/// `TURNS` user turns (paragraphs of the paper), each answered greedily and sent back.
/// `cold`: before each turn another prompt takes the server's one slot, so every turn is
/// computed from scratch. Returns the answers and each turn's cached prompt tokens.
fn conversation(addr: &str, cold: bool) -> (Vec<String>, Vec<u64>) {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/prima-cpp-excerpt.txt")).unwrap();
    let paras: Vec<&str> = text.split("\n\n").map(str::trim).filter(|p| p.len() > 200).collect();
    let mut messages = vec![json!({"role": "system", "content": format!("You review this paper. {}", paras[0])})];
    let (mut answers, mut cached) = (Vec::new(), Vec::new());
    for p in &paras[1..=TURNS] {
        if cold {
            post(addr, "/v1/completions", &json!({"model": "", "prompt": "Zebras graze on the plains.", "max_tokens": 2, "temperature": 0}));
        }
        let cut = p.char_indices().map(|(i, _)| i).take_while(|&i| i <= 400).last().unwrap_or(p.len());
        messages.push(json!({"role": "user", "content": format!("What does this say? {}", &p[..cut])}));
        // With each token's log-probability: a state a little off shows there first.
        let v = post(addr, "/v1/chat/completions", &json!({"model": "", "messages": messages, "max_tokens": 16, "temperature": 0, "logprobs": true}));
        let answer = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
        cached.push(v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0));
        messages.push(json!({"role": "assistant", "content": answer}));
        answers.push(format!("{answer} {}", v["choices"][0]["logprobs"]));
    }
    (answers, cached)
}

/// A prompt of real text filling the context but for the answer's 8 tokens (token ids
/// from `/tokenize`), answered greedily to the limit: its text and log-probabilities.
fn at_the_limit(addr: &str) -> String {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/prima-cpp-excerpt.txt")).unwrap();
    let tokens = post(addr, "/tokenize", &json!({"content": text}))["tokens"].as_array().unwrap().clone();
    let n = CTX.parse::<usize>().unwrap() - 8;
    assert!(tokens.len() > n, "the excerpt has only {} tokens", tokens.len());
    let v = post(addr, "/v1/completions", &json!({"model": "", "prompt": &tokens[..n], "max_tokens": 8, "temperature": 0, "logprobs": 2}));
    assert_eq!(v["usage"]["prompt_tokens"], n, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    format!("{} {}", v["choices"][0]["text"], v["choices"][0]["logprobs"])
}

/// Batch-invariant kernels: a prompt continued from a checkpoint is cut into other
/// batches than the same prompt computed cold, and with llama.cpp's own kernels a batch's
/// size moves the last bits; with these, only a wrong state could change an answer. A
/// conversation of `TURNS` turns, and a prompt that fills the context.
#[test]
fn a_conversation_reusing_checkpointed_state_equals_computing_every_turn_cold_single_node_and_ring() {
    let dir = std::env::temp_dir().join(format!("hearth-recurrent-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = model(&dir);
    let single = |extra: &[&str]| Served::start_model(&path, &[&["--threads", "1", "--parallel", "1", "--ctx-size", CTX, "--batch-invariant"][..], extra].concat());

    // Nothing kept beyond the slot either (the prompt cache would bring blocks back).
    let cold_node = single(&["--prompt-cache-ram", "0"]);
    let (cold, none) = conversation(&cold_node.addr, true);
    let limit = at_the_limit(&cold_node.addr);
    drop(cold_node);
    assert!(none.iter().all(|&c| c == 0), "cold turns reused a cache: {none:?}");
    assert!(cold.iter().any(|a| !a.is_empty()), "{cold:?}");

    let node = single(&[]);
    let (warm, cached) = conversation(&node.addr, false);
    assert_eq!(warm, cold, "answers from checkpointed state differ from answers computed cold");
    assert!(cached[1..].iter().all(|&c| c > 0), "turns after the first reused nothing: {cached:?}");
    let metrics = common::http(&node.addr, "GET", "/metrics", "", "").unwrap().body;
    let checkpoints = metrics.lines().find(|l| l.starts_with("hearth_state_checkpoints_total")).and_then(|l| l.split_whitespace().last()).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    assert!(checkpoints >= TURNS as f64, "{checkpoints} checkpoints for {TURNS} turns");
    drop(node);

    // Through a ring: each member keeps and checkpoints its own windows' state; a
    // relaying head, and one with layers.
    let w1 = Served::worker_at("127.0.0.1:0", &path, &["--threads", "1"]).unwrap();
    let w2 = Served::worker_at("127.0.0.1:0", &path, &["--threads", "1"]).unwrap();
    let workers = format!("{},{}", w1.addr, w2.addr);
    for windows in ["2,2,2", "0,3,3"] {
        let head = Served::start_model(&path, &["--threads", "1", "--parallel", "1", "--ctx-size", CTX, "--batch-invariant", "--workers", &workers, "--windows", windows]);
        let (ring, cached) = conversation(&head.addr, false);
        assert_eq!(ring, cold, "windows {windows}: the ring's answers differ from the single node's");
        assert!(cached[1..].iter().all(|&c| c > 0), "windows {windows}: turns after the first reused nothing: {cached:?}");
        assert_eq!(at_the_limit(&head.addr), limit, "windows {windows}: a prompt filling the context is answered otherwise than on the single node");
    }
    std::fs::remove_dir_all(&dir).ok();
}

fn counter(metrics: &str, name: &str) -> f64 {
    metrics.lines().find(|l| l.starts_with(name)).and_then(|l| l.split_whitespace().last()).and_then(|v| v.parse().ok()).unwrap_or(0.0)
}

/// Prompts sent at once, paragraphs of the paper: two greedy, two seeded samples, one of
/// them from the two likeliest tokens (a draft of greedy tokens is accepted there about
/// half the time: accepted in part, then rejected).
fn answers_together(addr: &str) -> Vec<String> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/prima-cpp-excerpt.txt")).unwrap();
    let paras: Vec<&str> = text.split("\n\n").map(str::trim).filter(|p| p.len() > 300).collect();
    let requests = [
        json!({"model": "", "prompt": paras[1], "max_tokens": 48, "temperature": 0, "logprobs": 2}),
        json!({"model": "", "prompt": paras[2], "max_tokens": 48, "temperature": 0, "logprobs": 2}),
        json!({"model": "", "prompt": paras[3], "max_tokens": 48, "temperature": 0.9, "top_p": 0.95, "seed": 42}),
        json!({"model": "", "prompt": paras[4], "max_tokens": 48, "temperature": 1.0, "top_k": 2, "seed": 7, "logprobs": 2}),
    ];
    std::thread::scope(|s| {
        let running: Vec<_> = requests.iter().map(|r| s.spawn(move || post(addr, "/v1/completions", r))).collect();
        running.into_iter().map(|h| {
            let v = h.join().unwrap();
            format!("{} {}", v["choices"][0]["text"], v["choices"][0]["logprobs"])
        }).collect()
    })
}

/// Speculative decoding on a recurrent model stays exact: each batch with drafts leaves a
/// snapshot of the state where its drafts begin, a rejection goes back to it and the
/// accepted drafts are computed again. Three requests decoding together (greedy and a
/// seeded sample) get the answers computed without speculation, on the single node and
/// through a ring of three processes. The drafts come from recurrent draft models (which
/// checkpoint their own state): the served model itself, whose greedy drafts the sampled
/// request accepts in part (the replay path), and another model, nearly always wrong. (A
/// random model's text never repeats, so n-gram drafts would propose nothing here;
/// `tests/speculation.rs` covers them, and they share the verification with draft models.
/// The same weights in Q8_0 agreed with no greedy choice: a random model's logits are
/// that flat.)
#[test]
fn speculation_on_qwen35_gives_the_answers_without_it_to_requests_decoding_together() {
    let dir = std::env::temp_dir().join(format!("hearth-recurrent-spec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = model(&dir);
    let itself = path.clone();
    let other = model_of(&dir, 5, engine::gguf::GgmlType::F16);
    let serve = |extra: &[&str]| Served::start_model(&path, &[&["--threads", "1", "--parallel", "3", "--ctx-size", CTX, "--batch-invariant"][..], extra].concat());

    let plain = serve(&[]);
    let truth = answers_together(&plain.addr);
    drop(plain);

    for (what, draft) in [("the model itself", &itself), ("another model", &other)] {
        let node = serve(&["--draft-model", draft.to_str().unwrap(), "--spec-tokens", "4"]);
        assert_eq!(answers_together(&node.addr), truth, "{what} drafting: the answers differ from those without speculation");
        let metrics = common::http(&node.addr, "GET", "/metrics", "", "").unwrap().body;
        let (proposed, accepted) = (counter(&metrics, "hearth_spec_draft_tokens_total"), counter(&metrics, "hearth_spec_accepted_tokens_total"));
        eprintln!("{what}: {accepted} of {proposed} drafts accepted");
        assert!(proposed > accepted, "{what}: no draft was rejected ({accepted} of {proposed})");
        if draft == &itself {
            assert!(accepted > 0.0, "{what}: no draft was accepted");
        }
    }

    let w1 = Served::worker_at("127.0.0.1:0", &path, &["--threads", "1"]).unwrap();
    let w2 = Served::worker_at("127.0.0.1:0", &path, &["--threads", "1"]).unwrap();
    let workers = format!("{},{}", w1.addr, w2.addr);
    let head = serve(&["--draft-model", itself.to_str().unwrap(), "--spec-tokens", "4", "--workers", &workers, "--windows", "2,2,2"]);
    assert_eq!(answers_together(&head.addr), truth, "the ring's speculative answers differ from the single node's");
    std::fs::remove_dir_all(&dir).ok();
}

/// Qwen3.5 served as a user brings it, with its own chat template (tools, `<think>`
/// generation prompt, tool results): a request that requires a call gets one, parsed into
/// `tool_calls` with arguments that follow the function's schema, streamed as a delta too;
/// the call and its result go back in and the model answers in text.
#[test]
fn qwen35_with_its_own_template_makes_a_required_tool_call_and_takes_its_result() {
    let dir = std::env::temp_dir().join(format!("hearth-recurrent-tools-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = model(&dir);
    common::own_template_makes_a_required_tool_call_and_takes_its_result(&path, concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/qwen3.5-chat-template.jinja"), &["--ctx-size", CTX]);
    std::fs::remove_dir_all(&dir).ok();
}

/// The prompt cache on a model keeping a recurrent state: every block's rows, and the
/// prompt's last whole block (and every `STATE_EVERY_BLOCKS`th) with the state where it ends (kept as the
/// prompt passed that point), so an agent's long context (1,100 tokens
/// of real prose) comes back after its slot served another conversation, after a hard
/// restart (from disk), and through a ring of three processes whose members each hold
/// their windows' state — every answer the one a server without any cache computes cold
/// (batch-invariant kernels: a prompt continued after restored blocks is cut into other
/// batches than when computed cold).
#[test]
fn a_recurrent_models_prompt_cache_brings_a_long_prefix_back_with_its_state_after_a_restart_and_through_a_ring() {
    const SHARED: usize = 1100;
    let dir = std::env::temp_dir().join(format!("hearth-recurrent-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = model(&dir);
    let cache_dir = dir.join("prompt-cache");
    let cache_arg = cache_dir.to_string_lossy().into_owned();
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/prima-cpp-excerpt.txt")).unwrap();
    let tk = engine::tokenizer::Tokenizer::load(&common::default_model()).unwrap();
    let ids: Vec<u32> = tk.tokenize(&text, false).iter().map(|&t| t as u32).collect();
    assert!(ids.len() >= 2000, "{} tokens", ids.len());
    let first = [&ids[..SHARED], &ids[1200..1300]].concat();
    let other = ids[1300..1900].to_vec();
    let again = [&ids[..SHARED], &ids[1900..1990]].concat();
    const BLOCK: usize = hearth::runtime::generation::BLOCK_TOKENS;
    const EVERY: usize = hearth::runtime::generation::STATE_EVERY_BLOCKS;
    let restored = (SHARED / BLOCK * BLOCK) as u64;
    let ask = |addr: &str, prompt: &[u32]| -> (String, u64) {
        let v = post(addr, "/v1/completions", &json!({"model": "", "prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 2}));
        (format!("{} {}", v["choices"][0]["text"], v["choices"][0]["logprobs"]), v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0))
    };
    let metrics = |addr: &str| common::http(addr, "GET", "/metrics", "", "").unwrap().body;
    let base = ["--threads", "1", "--parallel", "1", "--ctx-size", CTX, "--batch-invariant"];
    let with_cache = ["--prompt-cache-dir", cache_arg.as_str(), "--prompt-cache-size", "256"];
    let cold = {
        let node = Served::start_model(&path, &[&base[..], &["--prompt-cache-ram", "0", "--prompt-cache-size", "0"]].concat());
        let (cold, none) = ask(&node.addr, &again);
        assert_eq!(none, 0);
        cold
    };
    {
        let node = Served::start_model(&path, &[&base[..], &with_cache[..]].concat());
        ask(&node.addr, &first);
        ask(&node.addr, &other);
        assert_eq!(ask(&node.addr, &again), (cold.clone(), restored), "after the slot served another conversation");
        let m = metrics(&node.addr);
        assert_eq!(counter(&m, "hearth_prompt_cache_restored_tokens_total"), restored as f64);
        assert_eq!(counter(&m, "hearth_prompt_cache_hits_total{tier=\"ram\"}"), (restored / BLOCK as u64) as f64);
        // The rows alone of every whole block of the two prompts, and each prompt's last
        // whole block a restore reaches and every `EVERY`th with the state, reach the disk
        // before the server goes down hard.
        let reached = |n: usize| (n - 64) / 64 * 64 / BLOCK;
        let state_blocks = |n: usize| (1..=n / BLOCK).filter(|b| b % EVERY == 0 || *b == reached(n)).count();
        let on_disk = first.len() / BLOCK + other.len() / BLOCK + state_blocks(first.len()) + state_blocks(other.len());
        let files = || std::fs::read_dir(&cache_dir).into_iter().flatten().flatten().flat_map(|ns| std::fs::read_dir(ns.path()).into_iter().flatten().flatten()).filter(|f| !f.file_name().to_string_lossy().contains(".tmp.")).count();
        common::wait_for("the blocks on disk", std::time::Duration::from_secs(60), || (files() >= on_disk).then_some(()));
        let mut node = node;
        node.child.kill().unwrap();
        node.child.wait().unwrap();
    }
    {
        let node = Served::start_model(&path, &[&base[..], &with_cache[..]].concat());
        assert_eq!(ask(&node.addr, &again), (cold.clone(), restored), "after a restart");
        assert_eq!(counter(&metrics(&node.addr), "hearth_prompt_cache_hits_total{tier=\"disk\"}"), (restored / BLOCK as u64) as f64);
    }
    // Through a ring (another layout: none of the single node's blocks), a head with
    // layers and two workers, each holding recurrent layers' state.
    let w1 = Served::worker_at("127.0.0.1:0", &path, &["--threads", "1"]).unwrap();
    let w2 = Served::worker_at("127.0.0.1:0", &path, &["--threads", "1"]).unwrap();
    let workers = format!("{},{}", w1.addr, w2.addr);
    let ring = [&base[..], &with_cache[..], &["--workers", &workers, "--windows", "2,2,2"]].concat();
    {
        let head = Served::start_model(&path, &ring);
        assert_eq!(ask(&head.addr, &first).1, 0, "the single node's blocks are not the ring's");
        ask(&head.addr, &other);
        assert_eq!(ask(&head.addr, &again), (cold.clone(), restored), "through the ring, after the slot served another conversation");
    }
    let head = Served::start_model(&path, &ring);
    assert_eq!(ask(&head.addr, &again), (cold, restored), "through the ring, after the head restarted");
    std::fs::remove_dir_all(&dir).ok();
}
