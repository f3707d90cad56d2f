//! What users send, through the single node and the ring: prompts from 600 tokens to the
//! context limit in every window shape the ring tests use, a 20-turn conversation that
//! reuses its cache across turns, long and short requests at once, and speculation on
//! long prompts. The text is real prose (testdata/), because repeated words tokenize and
//! attend unlike what users send. The ring must give the single node's greedy output.
//!
//! A prompt longer than the largest batch (512 tokens) is fed in chunks; only the last
//! chunk wants logits. Every ring test before these used ~48-token prompts, and the head
//! aborted on the first chunk that wanted none.

mod common;

use std::path::PathBuf;

use common::Served;
use engine::tokenizer::Tokenizer;
use serde_json::{json, Value};

/// Context per sequence in these tests: long enough for three prompt chunks, short
/// enough that a prompt at the limit stays a test of seconds, not minutes.
const CTX: usize = 2048;
/// Every ring shape of the ring tests and the report: k = 1, uneven, a head that only
/// embeds and samples, a head with most layers, a relaying worker.
const SHAPES: &[&str] = &["10,10,10", "8,11,11", "0,15,15", "20,5,5", "15,0,15"];

fn excerpt() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/prima-cpp-excerpt.txt");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The excerpt's paragraphs of real prose (headings and author lines left out).
fn paragraphs() -> Vec<String> {
    excerpt().split("\n\n").map(str::trim).filter(|p| p.len() > 200).map(str::to_string).collect()
}

/// The first `n` tokens of the excerpt (no BOS: a prompt of ids is taken as it is).
fn excerpt_tokens(n: usize) -> Vec<u32> {
    let tk = Tokenizer::load(&common::default_model()).unwrap();
    let ids = tk.tokenize(&excerpt(), false);
    assert!(ids.len() >= n, "the excerpt has {} tokens, {n} wanted", ids.len());
    ids[..n].iter().map(|&t| t as u32).collect()
}

fn post(addr: &str, path: &str, body: &Value) -> Value {
    let r = common::http(addr, "POST", path, "", &body.to_string()).unwrap();
    assert_eq!(r.status, 200, "{path}: {}", r.body);
    serde_json::from_str(&r.body).unwrap()
}

/// A greedy completion of a prompt of token ids: (text, finish reason).
fn complete(addr: &str, prompt: &[u32], max_tokens: usize) -> (String, String) {
    let v = post(addr, "/v1/completions", &json!({"model": "", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}));
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len(), "{v}");
    (v["choices"][0]["text"].as_str().unwrap().to_string(), v["choices"][0]["finish_reason"].as_str().unwrap().to_string())
}

/// Prompt lengths: two chunks of the single node's 512, and at the context limit (the
/// answer stops for length when the context is full). 790, 916 and 980 leave a rest under
/// 64 tokens in chunks of 64 to 448, whichever a ring's plan takes (a multiple of 64: 768,
/// 896 and 960 divide by each of them), and none in the single node's 512: the rows of
/// that rest would round otherwise if the ring computed them apart.
fn long_prompts() -> Vec<(Vec<u32>, usize)> {
    vec![(excerpt_tokens(790), 16), (excerpt_tokens(916), 16), (excerpt_tokens(980), 16), (excerpt_tokens(CTX - 9), 32)]
}

fn workers() -> (Served, Served, String) {
    let w1 = Served::worker(&["--threads", "1"]);
    let w2 = Served::worker(&["--threads", "1"]);
    let list = format!("{},{}", w1.addr, w2.addr);
    (w1, w2, list)
}

fn head(ctx: usize, workers: &str, windows: &str, extra: &[&str]) -> Served {
    let ctx = ctx.to_string();
    let mut args = vec!["--threads", "1", "--parallel", "4", "--ctx-size", &ctx, "--workers", workers, "--windows", windows];
    args.extend_from_slice(extra);
    Served::start(&args)
}

/// The single node with the ring members' thread count: llama.cpp's attention for one
/// query past 512 cells splits the cells between threads, so the thread count decides
/// how its sums round.
fn single(ctx: usize, extra: &[&str]) -> Served {
    let ctx = ctx.to_string();
    let mut args = vec!["--threads", "1", "--parallel", "4", "--ctx-size", &ctx];
    args.extend_from_slice(extra);
    Served::start(&args)
}

#[test]
fn prompts_up_to_the_context_limit_give_the_single_node_output_in_every_ring_shape() {
    let prompts = long_prompts();
    let node = single(CTX, &[]);
    let expected: Vec<(String, String)> = prompts.iter().map(|(p, m)| complete(&node.addr, p, *m)).collect();
    assert_eq!(expected[3].1, "length", "a prompt at the limit stops when the context is full");
    let too_long = excerpt_tokens(CTX);
    let r = common::http(&node.addr, "POST", "/v1/completions", "", &json!({"model": "", "prompt": too_long, "max_tokens": 4}).to_string()).unwrap();
    assert_eq!(r.status, 400, "{}", r.body);
    let e: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!((e["error"]["code"].as_str(), e["error"]["param"].as_str()), (Some("context_length_exceeded"), Some("prompt")), "{}", r.body);
    // A chat names its messages as the field too long.
    let chat = json!({"model": "", "messages": [{"role": "user", "content": excerpt()}], "max_tokens": 4});
    let r = common::http(&node.addr, "POST", "/v1/chat/completions", "", &chat.to_string()).unwrap();
    let e: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!((r.status, e["error"]["code"].as_str(), e["error"]["param"].as_str()), (400, Some("context_length_exceeded"), Some("messages")), "{}", r.body);
    drop(node);

    let (_w1, _w2, list) = workers();
    // Also with micro-batches in flight whatever `auto` makes of this host: prompts then
    // travel in the chunks the plan chose (not the single node's 512).
    let h = head(CTX, &list, "10,10,10", &["--micro-batches", "3"]);
    for ((prompt, max), want) in prompts.iter().zip(&expected) {
        assert_eq!(&complete(&h.addr, prompt, *max), want, "3 micro-batches in flight, a prompt of {} tokens", prompt.len());
    }
    drop(h);
    for windows in SHAPES {
        // The default flags: micro-batches in flight as hearth chooses, prompts cut into the
        // chunks planned from the members' measured speeds (so they differ from host to
        // host), and still the single node's answers (no piece of a prompt is shorter
        // than a tile: `batcher::no_short_rest`).
        let h = head(CTX, &list, windows, &[]);
        for ((prompt, max), want) in prompts.iter().zip(&expected) {
            assert_eq!(&complete(&h.addr, prompt, *max), want, "windows {windows}, a prompt of {} tokens", prompt.len());
        }
        // The head is still whole and serving after the long prompts.
        let health: Value = serde_json::from_str(&common::http(&h.addr, "GET", "/health", "", "").unwrap().body).unwrap();
        assert_eq!(health["status"], "ok", "windows {windows}: {health}");
    }
}

/// Plays a conversation of `turns` user turns (paragraphs of the paper) with two tools
/// offered, each answered greedily and sent back as the assistant's message (a call gets
/// a tool result). Returns the answers (text and calls) and the cached prompt tokens each
/// turn reported.
fn conversation(addr: &str, turns: usize) -> (Vec<String>, Vec<u64>) {
    let paras = paragraphs();
    assert!(paras.len() >= turns + 1, "{} paragraphs for {turns} turns", paras.len());
    let tools = json!([
        {"type": "function", "function": {"name": "find_section", "description": "Find a section of the paper by its title and return its text.", "parameters": {"type": "object", "properties": {"title": {"type": "string", "description": "The section's title"}}, "required": ["title"]}}},
        {"type": "function", "function": {"name": "cite", "description": "Look up a reference of the paper by its number.", "parameters": {"type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]}}}
    ]);
    let mut messages = vec![json!({"role": "system", "content": format!("You are a helpful reviewer of this paper. {}", paras[0])})];
    let (mut answers, mut cached) = (Vec::new(), Vec::new());
    for p in &paras[1..=turns] {
        // A paragraph cut at a character boundary near 500 bytes: a few sentences.
        let cut = p.char_indices().map(|(i, _)| i).take_while(|&i| i <= 500).last().unwrap_or(p.len());
        messages.push(json!({"role": "user", "content": format!("What does this say? {}", &p[..cut])}));
        let v = post(addr, "/v1/chat/completions", &json!({"model": "", "messages": messages, "tools": tools, "max_tokens": 24, "temperature": 0}));
        let message = &v["choices"][0]["message"];
        let calls: Vec<(String, String)> = message["tool_calls"].as_array().into_iter().flatten().map(|c| (c["function"]["name"].as_str().unwrap_or("").to_string(), c["function"]["arguments"].as_str().unwrap_or("").to_string())).collect();
        let content = message["content"].as_str().unwrap_or("").to_string();
        cached.push(v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0));
        messages.push(json!({"role": "assistant", "content": content, "tool_calls": message["tool_calls"]}));
        for c in message["tool_calls"].as_array().into_iter().flatten() {
            messages.push(json!({"role": "tool", "tool_call_id": c["id"], "content": "Not found in this excerpt."}));
        }
        answers.push(format!("{content:?} {calls:?}"));
    }
    (answers, cached)
}

#[test]
fn a_twenty_turn_conversation_with_tools_through_the_ring_equals_the_single_node() {
    const TURNS: usize = 20;
    // Twenty turns of a few sentences each and their answers: about 3,000 tokens.
    const CONVERSATION_CTX: usize = 4096;
    let node = single(CONVERSATION_CTX, &[]);
    let (expected, _) = conversation(&node.addr, TURNS);
    drop(node);
    let (_w1, _w2, list) = workers();
    // The default flags, and three micro-batches in flight whatever `auto` makes of this
    // host (each turn's new tokens then travel in the chunks the plan chose).
    for extra in [&[][..], &["--micro-batches", "3"][..]] {
        let h = head(CONVERSATION_CTX, &list, "8,11,11", extra);
        let (got, cached) = conversation(&h.addr, TURNS);
        for (turn, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(g, e, "turn {} ({extra:?})", turn + 1);
        }
        // Each turn after the first continues the previous prompt: the ring reuses its cache.
        let reused = cached[1..].iter().filter(|&&c| c > 0).count();
        assert!(reused >= TURNS - 2, "cached prompt tokens per turn: {cached:?}");
    }
}

#[test]
fn long_and_short_requests_at_once_through_the_ring_give_their_answers_alone() {
    let long = excerpt_tokens(1500);
    let questions = ["Explain in detail how a bicycle works.", "Name three planets and one fact about each.", "Write a haiku about home clusters."];
    let chat = |addr: &str, q: &str| {
        let v = post(addr, "/v1/chat/completions", &json!({"model": "", "messages": [{"role": "user", "content": q}], "max_tokens": 32, "temperature": 0}));
        v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
    };
    // Batch-invariant kernels: with llama.cpp's own, a request's rounding depends on what
    // shares its batch (a clean-clone CI run saw the long answer change a word).
    let node = single(CTX, &["--batch-invariant"]);
    let long_alone = complete(&node.addr, &long, 24);
    let short_alone: Vec<String> = questions.iter().map(|q| chat(&node.addr, q)).collect();
    drop(node);

    let (_w1, _w2, list) = workers();
    let h = head(CTX, &list, "10,10,10", &["--batch-invariant"]);
    std::thread::scope(|s| {
        let addr = h.addr.as_str();
        let long_run = s.spawn(|| complete(addr, &long, 24));
        let shorts: Vec<_> = questions.iter().map(|q| s.spawn(move || chat(addr, q))).collect();
        for (i, t) in shorts.into_iter().enumerate() {
            assert_eq!(t.join().unwrap(), short_alone[i], "short request {i} beside a long one");
        }
        assert_eq!(long_run.join().unwrap(), long_alone, "the long request beside short ones");
    });
}

#[test]
fn speculation_on_long_prompts_gives_the_plain_answer() {
    // A passage the model tends to continue by copying: drafts get accepted and rejected.
    let prompt = excerpt_tokens(1100);
    // Speculation computes with batch-invariant kernels (a verified draft must compute as
    // it would alone); the plain answer is decoding one token at a time with them.
    let node = single(CTX, &["--batch-invariant"]);
    let expected = complete(&node.addr, &prompt, 48);
    drop(node);
    let (_w1, _w2, list) = workers();
    let h = head(CTX, &list, "8,11,11", &["--batch-invariant"]);
    assert_eq!(complete(&h.addr, &prompt, 48), expected, "batch-invariant ring, no drafts");
    drop(h);

    let ngram = single(CTX, &["--spec-mode", "ngram"]);
    assert_eq!(complete(&ngram.addr, &prompt, 48), expected, "n-gram drafts, one node");
    drop(ngram);
    let model = common::default_model();
    let draft = single(CTX, &["--draft-model", model.to_str().unwrap()]);
    assert_eq!(complete(&draft.addr, &prompt, 48), expected, "the model as its own draft, one node");
    drop(draft);

    let h = head(CTX, &list, "8,11,11", &["--spec-mode", "ngram"]);
    assert_eq!(complete(&h.addr, &prompt, 48), expected, "n-gram drafts through the ring");
    drop(h);
    let h = head(CTX, &list, "0,15,15", &["--draft-model", model.to_str().unwrap()]);
    assert_eq!(complete(&h.addr, &prompt, 48), expected, "a draft model through the ring");
}

/// Eight requests of every kind users send at once through a ring with micro-batches in
/// flight (one per member: the sequences go round in groups of two or three, the long prompt in chunks that
/// follow one another): each gets the answer it gets alone on the single node. Then a client
/// that goes away while its prompt's chunks are in flight frees its sequence without
/// disturbing the next request.
#[test]
fn eight_mixed_requests_through_a_pipelined_ring_give_their_answers_alone() {
    let long = excerpt_tokens(1100);
    let questions = ["Explain in detail how a bicycle works.", "Name three planets and one fact about each.", "Write a haiku about home clusters.", "How do I bake bread?", "What is a GGUF file?"];
    let chat = |addr: &str, q: &str, extra: Value| {
        let mut body = json!({"model": "", "messages": [{"role": "user", "content": q}], "max_tokens": 32, "temperature": 0});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let v = post(addr, "/v1/chat/completions", &body);
        v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
    };
    let seeded = json!({"temperature": 0.9, "seed": 7, "top_p": 0.95});
    let stream = |addr: &str| {
        let body = json!({"model": "", "prompt": "The three laws of thermodynamics are", "max_tokens": 40, "temperature": 0, "stream": true}).to_string();
        let r = common::http(addr, "POST", "/v1/completions", "", &body).unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        r.body.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).filter_map(|d| serde_json::from_str::<Value>(d).ok()).filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string)).collect::<String>()
    };
    // Batch-invariant kernels: with llama.cpp's own a request's rounding depends on what
    // shares its micro-batch, and the ring's groups differ from the single node's batch.
    let ctx = CTX.to_string();
    let node = Served::start(&["--threads", "1", "--parallel", "8", "--ctx-size", &ctx, "--batch-invariant"]);
    let alone: Vec<String> = questions.iter().map(|q| chat(&node.addr, q, json!({}))).collect();
    let seeded_alone = chat(&node.addr, questions[0], seeded.clone());
    let long_alone = complete(&node.addr, &long, 24);
    let stream_alone = stream(&node.addr);
    drop(node);

    let (_w1, _w2, list) = workers();
    // Pinned at one per member: `auto` may keep one per stream here (the small model's
    // batches of a few rows cost nearly as many single rows), and groups of several
    // sequences are what this test is for.
    let h = Served::start(&["--threads", "1", "--parallel", "8", "--ctx-size", &ctx, "--workers", &list, "--windows", "10,10,10", "--batch-invariant", "--admin-key", "admin-key", "--micro-batches", "3"]);
    let plan: Value = serde_json::from_str(&common::http(&h.addr, "GET", "/admin/plan", "Authorization: Bearer admin-key\r\n", "").unwrap().body).unwrap();
    assert_eq!(plan["micro_batches"], 3, "one micro-batch per member: {plan}");
    let f = &plan["forecast"];
    // Several streams sustain more than one. (Against one micro-batch at a time the
    // forecast at this pinned depth may lose: on a CPU the default model's output layer
    // takes 2–3 rows at several times one row's cost and 8 at little more, which is why
    // `auto` keeps more.)
    assert!(f["streams"][2]["pipelined_tokens_per_s"].as_f64().unwrap() > f["streams"][0]["pipelined_tokens_per_s"].as_f64().unwrap(), "{f}");
    assert!(f["prompts"][1]["chunk"].as_u64().unwrap() < 512, "a 2,000-token prompt is cut into chunks: {f}");
    std::thread::scope(|s| {
        let addr = h.addr.as_str();
        let shorts: Vec<_> = questions.iter().map(|q| s.spawn(move || chat(addr, q, json!({})))).collect();
        let seeded_run = s.spawn(|| chat(addr, questions[0], seeded.clone()));
        let long_run = s.spawn(|| complete(addr, &long, 24));
        let stream_run = s.spawn(|| stream(addr));
        for (i, t) in shorts.into_iter().enumerate() {
            assert_eq!(t.join().unwrap(), alone[i], "short request {i} among eight");
        }
        assert_eq!(seeded_run.join().unwrap(), seeded_alone, "seeded sampling among eight");
        assert_eq!(long_run.join().unwrap(), long_alone, "the 1,100-token prompt among eight");
        assert_eq!(stream_run.join().unwrap(), stream_alone, "the stream among eight");
    });
    // A client that gives up while its long prompt is in flight.
    {
        use std::io::Write;
        let body = json!({"model": "", "prompt": long, "max_tokens": 24, "temperature": 0}).to_string();
        let mut c = std::net::TcpStream::connect(&h.addr).unwrap();
        write!(c, "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(300));
    }
    assert_eq!(complete(&h.addr, &long, 24), long_alone, "the long prompt after a client gave it up in flight");
    assert_eq!(chat(&h.addr, questions[1], json!({})), alone[1]);
}

/// A counter or gauge of a server's /metrics (0 before it is first set).
fn metric(addr: &str, name: &str) -> f64 {
    let body = common::http(addr, "GET", "/metrics", "", "").unwrap().body;
    body.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok()).unwrap_or(0.0)
}

/// Agents sharing a long system prompt (700 tokens of real prose), on the single node and
/// through a ring of three: a request that arrives while another with the same system
/// prompt is generating takes the prefix from the other's slot instead of computing it —
/// whole tiles of it, at least a tile before its own end (`cached_tokens` and
/// `hearth_prompt_copied_tokens_total` say how much) — and gives the answer a fresh single
/// node computes cold. Batch-invariant kernels: the copied request's rows share batches
/// with the running one's, and llama.cpp's own kernels round a row by what shares its batch.
#[test]
fn a_request_sharing_a_system_prompt_with_a_running_one_copies_its_prefix_and_answers_as_cold() {
    const SYSTEM: usize = 700;
    let tk = Tokenizer::load(&common::default_model()).unwrap();
    let ids: Vec<u32> = tk.tokenize(&excerpt(), false).iter().map(|&t| t as u32).collect();
    assert!(ids.len() >= 1600, "{} tokens", ids.len());
    let running = [&ids[..SYSTEM], &ids[1000..1040]].concat();
    let arriving = [&ids[..SYSTEM], &ids[1500..1600]].concat();
    // The running request generates until it is told to stop: no end-of-generation token.
    let eog: serde_json::Map<String, Value> = (0..tk.n_vocab() as i32).filter(|&t| tk.is_eog(t)).map(|t| (t.to_string(), json!(-100))).collect();
    let tile = 64;
    let copied = SYSTEM.min(arriving.len() - tile) / tile * tile;
    let cold = {
        let node = single(CTX, &["--batch-invariant"]);
        complete(&node.addr, &arriving, 24)
    };
    let (_w1, _w2, list) = workers();
    for ring in [false, true] {
        let server = if ring { head(CTX, &list, "8,11,11", &["--batch-invariant"]) } else { single(CTX, &["--batch-invariant"]) };
        let addr = server.addr.as_str();
        std::thread::scope(|s| {
            let long = s.spawn(|| post(addr, "/v1/completions", &json!({"model": "", "prompt": running, "max_tokens": 200, "temperature": 0, "logit_bias": eog})));
            common::wait_for("the first request to be generating", std::time::Duration::from_secs(120), || (metric(addr, "hearth_generated_tokens_total") >= 4.0).then_some(()));
            let v = post(addr, "/v1/completions", &json!({"model": "", "prompt": arriving, "max_tokens": 24, "temperature": 0}));
            let what = if ring { "ring 8,11,11" } else { "single node" };
            assert_eq!((v["choices"][0]["text"].as_str().unwrap(), v["choices"][0]["finish_reason"].as_str().unwrap()), (cold.0.as_str(), cold.1.as_str()), "{what}: the answer after a copied prefix");
            assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], copied, "{what}: {v}");
            assert_eq!(metric(addr, "hearth_prompt_copied_tokens_total"), copied as f64, "{what}");
            let first = long.join().unwrap();
            assert_eq!(first["usage"]["completion_tokens"], 200, "{what}: the first request ran on: {first}");
        });
    }
}

fn metric_with(addr: &str, name: &str, labels: &str) -> f64 {
    metric(addr, &format!("{name}{{{labels}}}"))
}

/// Every block file under a prompt-cache directory (one subdirectory per namespace).
fn block_files(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir).into_iter().flatten().flatten().flat_map(|ns| std::fs::read_dir(ns.path()).into_iter().flatten().flatten().map(|f| f.path())).filter(|p| !p.to_string_lossy().contains(".tmp.")).collect();
    out.sort();
    out
}

/// An agent's long context (1,100 tokens of real prose) sent again after its slot served
/// another conversation, after the server restarted, after one of its blocks was lost,
/// and to a server with another cache type: the prompt cache restores every whole block it
/// holds of the prefix (`cached_tokens`), stops at the first one it lacks, never reads
/// another namespace's, and the answer — greedy and seeded — is the one a server without
/// any cache computes cold.
#[test]
fn a_long_prefix_comes_back_from_the_prompt_cache_after_its_slot_was_reused_and_after_a_restart_and_answers_as_cold() {
    const SHARED: usize = 1100;
    let tk = Tokenizer::load(&common::default_model()).unwrap();
    let ids: Vec<u32> = tk.tokenize(&excerpt(), false).iter().map(|&t| t as u32).collect();
    assert!(ids.len() >= 2000, "{} tokens", ids.len());
    let first = [&ids[..SHARED], &ids[1200..1300]].concat();
    let other = ids[1300..1900].to_vec();
    let again = [&ids[..SHARED], &ids[1900..1990]].concat();
    let block = hearth::runtime::generation::BLOCK_TOKENS;
    let restored = SHARED / block * block;
    let dir = std::env::temp_dir().join(format!("hearth-prompt-cache-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let dir_arg = dir.to_string_lossy().into_owned();
    let ctx = CTX.to_string();
    let base = ["--threads", "1", "--parallel", "1", "--ctx-size", ctx.as_str()];
    let start = |extra: &[&str]| Served::start(&[&base[..], extra].concat());
    let with_cache = ["--prompt-cache-dir", dir_arg.as_str(), "--prompt-cache-size", "256"];
    let seeded = |addr: &str| {
        let v = post(addr, "/v1/completions", &json!({"model": "", "prompt": again, "max_tokens": 24, "temperature": 0.9, "seed": 7}));
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let cached = |addr: &str| -> (String, u64) {
        let v = post(addr, "/v1/completions", &json!({"model": "", "prompt": again, "max_tokens": 24, "temperature": 0}));
        (v["choices"][0]["text"].as_str().unwrap().to_string(), v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0))
    };
    let (cold, cold_seeded) = {
        let node = start(&["--prompt-cache-ram", "0", "--prompt-cache-size", "0"]);
        let cold = cached(&node.addr);
        assert_eq!(cold.1, 0, "no cache: nothing cached");
        // Computed from scratch again: another conversation took the only slot.
        complete(&node.addr, &other, 8);
        let cold_seeded = seeded(&node.addr);
        assert_eq!(metric(&node.addr, "hearth_prompt_cache_restored_tokens_total"), 0.0);
        (cold.0, cold_seeded)
    };
    {
        let node = start(&with_cache);
        complete(&node.addr, &first, 8);
        // Another conversation takes the only slot: the first one's rows leave it.
        complete(&node.addr, &other, 8);
        let (text, got) = cached(&node.addr);
        assert_eq!((text.as_str(), got), (cold.as_str(), restored as u64), "after the slot was reused");
        assert_eq!(metric(&node.addr, "hearth_prompt_cache_restored_tokens_total"), restored as f64);
        assert_eq!(metric_with(&node.addr, "hearth_prompt_cache_hits_total", "tier=\"ram\""), (restored / block) as f64);
        // Every whole block of the two conversations reached the disk before the server
        // goes down hard.
        let blocks = first.len() / block + other.len() / block;
        common::wait_for("the blocks on disk", std::time::Duration::from_secs(60), || (block_files(&dir).len() >= blocks).then_some(()));
        let mut node = node;
        node.child.kill().unwrap();
        node.child.wait().unwrap();
    }
    {
        let node = start(&with_cache);
        let (text, got) = cached(&node.addr);
        assert_eq!((text.as_str(), got), (cold.as_str(), restored as u64), "after a restart");
        assert_eq!(metric_with(&node.addr, "hearth_prompt_cache_hits_total", "tier=\"disk\""), (restored / block) as f64);
        assert!(metric_with(&node.addr, "hearth_prompt_cache_read_bytes_total", "tier=\"disk\"") > 0.0);
        // The slot serves another conversation again; seeded sampling from the cache too.
        complete(&node.addr, &other, 8);
        assert_eq!(seeded(&node.addr), cold_seeded, "seeded, after a restart");
        // Sent again at once, the prompt reuses its own slot: whole tiles of it, a tile
        // before its end, so that this answer too is the cold one.
        let (text, got) = cached(&node.addr);
        assert_eq!((text.as_str(), got), (cold.as_str(), ((again.len() - 64) / 64 * 64) as u64), "sent again");
    }
    // A block in the middle of the prefix is lost (evicted by another server sharing the
    // directory, a disk cleaner): the blocks before it come back, the rest is computed. A
    // file's header holds its block's tokens after 116 bytes.
    let second: Vec<u8> = ids[2 * block..2 * block + 4].iter().flat_map(|&t| (t as i32).to_le_bytes()).collect();
    let lost = block_files(&dir).into_iter().find(|f| std::fs::read(f).is_ok_and(|b| b.len() > 132 && b[116..132] == second[..])).expect("the prefix's third block on disk");
    std::fs::remove_file(&lost).unwrap();
    {
        let node = start(&with_cache);
        let (text, got) = cached(&node.addr);
        assert_eq!((text.as_str(), got), (cold.as_str(), 2 * block as u64), "with the third block lost");
        assert!(metric(&node.addr, "hearth_prompt_cache_misses_total") >= 1.0);
    }
    // Another cache type is another namespace: none of these blocks is read.
    {
        let node = start(&[&with_cache[..], &["--cache-type-k", "q8_0"]].concat());
        assert_eq!(cached(&node.addr).1, 0, "another cache type");
        assert_eq!(metric(&node.addr, "hearth_prompt_cache_restored_tokens_total"), 0.0);
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The prompt cache through a ring of three, each member keeping its own windows' rows of
/// every block (the head its own, each worker its own, on its own disk: a block's rows
/// never cross the network): a prefix comes back after its slot served another
/// conversation, and after the head and a worker restarted (both from disk), with the
/// single node's cold answer; a worker that lost the last two blocks of the prefix gives
/// back the ones before them (the restore's frames go round together) and the head
/// computes the rest; a worker that restarted without its blocks makes the head
/// compute the prefix and keep it again (still the cold answer), and the next request
/// restores it; a plan that moves the layers lays rows out otherwise, so its ring
/// restores none of them (and still answers as cold).
#[test]
fn through_a_ring_each_member_keeps_its_rows_of_a_prefix_across_restarts_and_a_new_plan_reads_none() {
    const SHARED: usize = 1100;
    let tk = Tokenizer::load(&common::default_model()).unwrap();
    let ids: Vec<u32> = tk.tokenize(&excerpt(), false).iter().map(|&t| t as u32).collect();
    let first = [&ids[..SHARED], &ids[1200..1300]].concat();
    let other = ids[1300..1900].to_vec();
    let again = [&ids[..SHARED], &ids[1900..1990]].concat();
    const BLOCK: usize = hearth::runtime::generation::BLOCK_TOKENS;
    let restored = (SHARED / BLOCK * BLOCK) as u64;
    // The prefix's last two blocks a restore reaches start here.
    let lost_from = restored as usize - 2 * BLOCK;
    let dir = std::env::temp_dir().join(format!("hearth-prompt-cache-ring-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let member_dir = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let (head_dir, w1_dir, w2_dir) = (member_dir("head"), member_dir("worker-1"), member_dir("worker-2"));
    let ctx = CTX.to_string();
    let cached = |addr: &str| -> (String, u64) {
        let v = post(addr, "/v1/completions", &json!({"model": "", "prompt": again, "max_tokens": 24, "temperature": 0}));
        (v["choices"][0]["text"].as_str().unwrap().to_string(), v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0))
    };
    let cold = {
        let node = Served::start(&["--threads", "1", "--parallel", "1", "--ctx-size", ctx.as_str(), "--prompt-cache-ram", "0", "--prompt-cache-size", "0"]);
        cached(&node.addr).0
    };
    let worker_at = |addr: &str, blocks: &str| {
        let w = (0..50).find_map(|_| {
            Served::worker_at(addr, &common::default_model(), &["--threads", "1", "--prompt-cache-dir", blocks, "--prompt-cache-size", "256"]).ok().or_else(|| {
                std::thread::sleep(std::time::Duration::from_millis(200));
                None
            })
        });
        w.expect("the worker starts where it was")
    };
    let w1 = worker_at("127.0.0.1:0", &w1_dir);
    let w2 = worker_at("127.0.0.1:0", &w2_dir);
    let list = format!("{},{}", w1.addr, w2.addr);
    let ring = |windows: &str| Served::start(&["--threads", "1", "--parallel", "1", "--ctx-size", ctx.as_str(), "--workers", list.as_str(), "--windows", windows, "--prompt-cache-dir", head_dir.as_str(), "--prompt-cache-size", "256"]);
    {
        let mut h = ring("8,11,11");
        complete(&h.addr, &first, 8);
        complete(&h.addr, &other, 8);
        assert_eq!(cached(&h.addr), (cold.clone(), restored), "after the slot was reused");
        assert_eq!(metric_with(&h.addr, "hearth_prompt_cache_hits_total", "tier=\"ram\""), (restored / BLOCK as u64) as f64);
        // Each member wrote its own rows of every whole block of the two conversations;
        // the head's hold its rows only, a third of the layers.
        let blocks = first.len() / BLOCK + other.len() / BLOCK;
        for d in [&head_dir, &w1_dir, &w2_dir] {
            common::wait_for("the blocks on disk", std::time::Duration::from_secs(60), || (block_files(std::path::Path::new(d)).len() >= blocks).then_some(()));
        }
        let size = |d: &str| block_files(std::path::Path::new(d)).iter().map(|f| std::fs::metadata(f).unwrap().len()).sum::<u64>();
        assert!(size(&head_dir) < size(&w1_dir), "the head's blocks hold its 8 layers' rows, a worker's its 11: {} against {}", size(&head_dir), size(&w1_dir));
        h.child.kill().unwrap();
        h.child.wait().unwrap();
    }
    // The head and a worker restart (the worker where it was, on its directory).
    let w1_addr = w1.addr.clone();
    drop(w1);
    let w1 = worker_at(&w1_addr, &w1_dir);
    {
        let h = ring("8,11,11");
        assert_eq!(cached(&h.addr), (cold.clone(), restored), "after the head and a worker restarted");
        assert_eq!(metric_with(&h.addr, "hearth_prompt_cache_hits_total", "tier=\"disk\""), (restored / BLOCK as u64) as f64);
    }
    // The worker restarts on its directory without its last two blocks of the prefix (its
    // LRU took them, say): the restore's frames go round together, the blocks before
    // them come back, the head cuts at the miss, computes the rest and keeps it again, and the
    // next request restores the whole prefix.
    drop(w1);
    // A file is named by its block's id, the same on every member; the head's files hold
    // the block's tokens too.
    let lost: Vec<std::ffi::OsString> = block_files(std::path::Path::new(&head_dir))
        .into_iter()
        .filter(|f| {
            let bytes = std::fs::read(f).unwrap();
            let holds = |tokens: &[u32]| {
                let le: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
                bytes.windows(le.len()).any(|w| w == le.as_slice())
            };
            holds(&ids[lost_from..lost_from + BLOCK]) || holds(&ids[lost_from + BLOCK..lost_from + 2 * BLOCK])
        })
        .map(|f| f.file_name().unwrap().to_owned())
        .collect();
    assert_eq!(lost.len(), 2, "the head's files of the prefix's last two blocks");
    let worker_files = block_files(std::path::Path::new(&w1_dir));
    for name in &lost {
        let f = worker_files.iter().find(|f| f.file_name() == Some(name)).expect("the worker keeps the block under the head's id");
        std::fs::remove_file(f).unwrap();
    }
    let w1 = worker_at(&w1_addr, &w1_dir);
    {
        let h = ring("8,11,11");
        assert_eq!(cached(&h.addr), (cold.clone(), lost_from as u64), "a worker missing the prefix's last two blocks");
        complete(&h.addr, &other, 8);
        assert_eq!(cached(&h.addr), (cold.clone(), restored), "kept again");
    }
    // The worker restarts again without its blocks: the head's first write of them misses
    // there, the prefix is computed and kept again, and the next request restores it.
    drop(w1);
    let w1 = worker_at(&w1_addr, &member_dir("worker-1-elsewhere"));
    {
        let h = ring("8,11,11");
        assert_eq!(cached(&h.addr), (cold.clone(), 0), "a worker without its blocks");
        complete(&h.addr, &other, 8);
        assert_eq!(cached(&h.addr), (cold.clone(), restored), "kept again");
    }
    {
        let h = ring("10,10,10");
        assert_eq!(cached(&h.addr), (cold.clone(), 0), "another plan");
        assert_eq!(metric(&h.addr, "hearth_prompt_cache_restored_tokens_total"), 0.0);
    }
    drop((w1, w2));
    std::fs::remove_dir_all(&dir).ok();
}

/// An answer does not depend on what its slot held before (issue 61, found on a Q4_K_M
/// model): requests sent one after another to a server with one slot — a paragraph; a short
/// prompt; a long one sharing only its first token with the short one; that conversation
/// going on after its answer — each answer the one a fresh server gives. A reused row that
/// shifts how the rows after it are grouped (one shared token: ggml's repacked matmuls take
/// a batch's rows in fours from its first), or an answer's rows decoded one at a time
/// reused as prompt rows, changes the greedy text of the repacked and K-quant types.
/// Every weight type family hearth's kernels treat apart: plain (the default Q4_1, F16),
/// repacked (Q4_0, Q4_K_M, IQ4_NL, Q8_0) and other K-quants (Q6_K); for Q4_K_M also
/// through a ring of three, and from the prompt cache on disk after a restart.
#[test]
fn an_answer_does_not_depend_on_what_the_slot_held_before_on_every_weight_type() {
    let tk = Tokenizer::load(&common::default_model()).unwrap();
    let ids: Vec<u32> = tk.tokenize(&excerpt(), false).iter().map(|&t| t as u32).collect();
    assert!(ids.len() >= 2100, "{} tokens", ids.len());
    let first = ids[..300].to_vec();
    let short = [&ids[..1], &ids[2000..2030]].concat();
    let long = [&ids[..1], &ids[1000..1250]].concat();
    let dir = std::env::temp_dir().join(format!("hearth-slot-history-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ctx = CTX.to_string();
    let base = ["--threads", "1", "--parallel", "1", "--ctx-size", ctx.as_str(), "--prompt-cache-ram", "0", "--prompt-cache-size", "0"];
    for ty in ["default", "f16", "q4_0", "q4_k_m", "iq4_nl", "q8_0", "q6_k"] {
        let path = if ty == "default" {
            common::default_model()
        } else {
            let path = dir.join(format!("default-{ty}.gguf"));
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_hearth-under-test"))
                .args(["quantize", common::default_model().to_str().unwrap(), path.to_str().unwrap(), "--type", ty])
                .output()
                .unwrap();
            assert!(out.status.success(), "hearth quantize --type {ty}: {}", String::from_utf8_lossy(&out.stderr));
            path
        };
        // One after another in one slot.
        let node = Served::start_model(&path, &base);
        let got_first = complete(&node.addr, &first, 24);
        let got_short = complete(&node.addr, &short, 8);
        let got_long = complete(&node.addr, &long, 24);
        let answer: Vec<u32> = tk.tokenize(&got_long.0, false).iter().map(|&t| t as u32).collect();
        let next = [&long[..], &answer[..], &ids[1300..1400]].concat();
        let got_next = complete(&node.addr, &next, 24);
        drop(node);
        // Each on a fresh server.
        let fresh = |prompt: &[u32], max: usize| complete(&Served::start_model(&path, &base).addr, prompt, max);
        assert_eq!(got_first, fresh(&first, 24), "{ty}: the first request");
        assert_eq!(got_long, fresh(&long, 24), "{ty}: a prompt sharing one token with the slot's short prompt");
        let fresh_next = fresh(&next, 24);
        assert_eq!(got_next, fresh_next, "{ty}: the conversation after its answer");
        assert_eq!(got_short, fresh(&short, 8), "{ty}: the short prompt");
        if ty != "q4_k_m" {
            continue;
        }
        // Through a ring of three, the slot's history the same (prompt pieces of the single
        // node's batch: a piece's rows round by the batch they are computed in).
        let w1 = Served::worker_at("127.0.0.1:0", &path, &["--threads", "1"]).unwrap();
        let w2 = Served::worker_at("127.0.0.1:0", &path, &["--threads", "1"]).unwrap();
        let workers = format!("{},{}", w1.addr, w2.addr);
        let ring = Served::start_model(&path, &[&base[..], &["--workers", &workers, "--windows", "10,10,10", "--prompt-chunk", "512"]].concat());
        assert_eq!(complete(&ring.addr, &first, 24), got_first, "{ty}, ring: the first request");
        complete(&ring.addr, &short, 8);
        assert_eq!(complete(&ring.addr, &long, 24), got_long, "{ty}, ring: a prompt sharing one token with the slot's short prompt");
        assert_eq!(complete(&ring.addr, &next, 24), fresh_next, "{ty}, ring: the conversation after its answer");
        drop((ring, w1, w2));
        // The prompt cache on disk: the long prompt's blocks kept, the server restarted,
        // the conversation's next turn restored from them.
        let cache = dir.join("prompt-cache");
        let cache_arg = cache.to_string_lossy().into_owned();
        let with_cache = ["--threads", "1", "--parallel", "1", "--ctx-size", ctx.as_str(), "--prompt-cache-dir", cache_arg.as_str(), "--prompt-cache-size", "64"];
        {
            let node = Served::start_model(&path, &with_cache);
            complete(&node.addr, &short, 8);
            assert_eq!(complete(&node.addr, &next, 24), fresh_next, "{ty}: the conversation's turn, keeping blocks");
            common::wait_for("a block on disk", std::time::Duration::from_secs(60), || (!block_files(&cache).is_empty()).then_some(()));
        }
        let node = Served::start_model(&path, &with_cache);
        let v = post(&node.addr, "/v1/completions", &json!({"model": "", "prompt": next, "max_tokens": 24, "temperature": 0}));
        assert!(v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0) >= 256, "{ty}: restored after a restart: {v}");
        assert_eq!((v["choices"][0]["text"].as_str().unwrap(), v["choices"][0]["finish_reason"].as_str().unwrap()), (fresh_next.0.as_str(), fresh_next.1.as_str()), "{ty}: restored after a restart");
    }
    std::fs::remove_dir_all(&dir).ok();
}
