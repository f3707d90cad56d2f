//! Speculative decoding with n-gram (prompt lookup) drafts: the same answer as without it,
//! greedy and seeded-sampled, on one node and across head + 2 workers, in fewer trips
//! through the pipeline than tokens on a repetitive text.

mod common;


use common::Served;
use serde_json::Value;

/// A text the model continues by copying itself.
const PROMPT: &str = "The cat sat on the mat.\\nThe cat sat on the mat.\\nThe cat sat on the mat.\\nThe cat sat on the mat.\\nThe cat sat on the mat.\\nThe cat";
const TOKENS: usize = 64;

fn http(addr: &str, method_path: &str, body: &str) -> String {
    let (method, path) = method_path.split_once(' ').unwrap();
    let r = common::http(addr, method, path, "", body).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    r.body
}

/// The completion's text; `sampling` adds fields such as `"temperature":0`.
fn complete(addr: &str, sampling: &str) -> String {
    let body = format!(r#"{{"model":"","prompt":"{PROMPT}","max_tokens":{TOKENS},{sampling}}}"#);
    let v: Value = serde_json::from_str(&http(addr, "POST /v1/completions", &body)).unwrap();
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

fn counter(metrics: &str, name: &str) -> f64 {
    metrics.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok())).unwrap_or(0.0)
}

const GREEDY: &str = r#""temperature":0"#;
const SAMPLED: &str = r#""temperature":0.9,"top_p":0.95,"seed":42"#;

#[test]
fn ngram_drafts_give_the_same_answer_in_fewer_steps() {
    let plain = Served::start(&["--threads", "2", "--parallel", "2"]);
    let greedy = complete(&plain.addr, GREEDY);
    let sampled = complete(&plain.addr, SAMPLED);
    drop(plain);

    let spec = Served::start(&["--threads", "2", "--parallel", "2", "--spec-mode", "ngram"]);
    assert_eq!(complete(&spec.addr, GREEDY), greedy);
    let metrics = http(&spec.addr, "GET /metrics", "");
    let steps = counter(&metrics, "hearth_decode_sequence_steps_total");
    let tokens = counter(&metrics, "hearth_generated_tokens_total");
    let proposed = counter(&metrics, "hearth_spec_draft_tokens_total");
    let accepted = counter(&metrics, "hearth_spec_accepted_tokens_total");
    eprintln!("greedy: {tokens} tokens in {steps} decode steps; drafts {accepted} of {proposed} accepted");
    assert!(tokens >= 32.0, "the greedy answer runs long: {greedy:?}");
    assert!(steps > 0.0 && steps < tokens * 0.5, "{steps} steps for {tokens} tokens:\n{metrics}");
    assert!(accepted > 0.0 && accepted <= proposed, "{metrics}");
    // A seeded sampled answer: every emitted token is one draw of the same sampler, so the
    // same seed gives the same text with drafts or without.
    assert_eq!(complete(&spec.addr, SAMPLED), sampled);
}

#[test]
fn ngram_drafts_across_the_ring_give_the_single_node_answer() {
    let single = Served::start(&["--threads", "1"]);
    let expected = complete(&single.addr, GREEDY);
    drop(single);
    let w1 = Served::worker(&["--threads", "1"]);
    let w2 = Served::worker(&["--threads", "1"]);
    let head = Served::start(&["--threads", "1", "--workers", &format!("{},{}", w1.addr, w2.addr), "--windows", "4,3,3", "--spec-mode", "ngram"]);
    assert_eq!(complete(&head.addr, GREEDY), expected);
    // Rejected drafts are cut from every member's cache in-band: a second request that
    // reuses the prompt's cache still gives the same answer.
    assert_eq!(complete(&head.addr, GREEDY), expected);
    let metrics = http(&head.addr, "GET /metrics", "");
    let trips = counter(&metrics, "hearth_ring_round_trip_seconds_count");
    let tokens = counter(&metrics, "hearth_generated_tokens_total");
    assert!(trips > 0.0 && tokens / (trips / 3.0) > 1.2, "{tokens} tokens in {trips} ring round trips (3 rounds a step):\n{metrics}");
}

#[test]
fn the_model_as_its_own_draft_is_always_right_and_changes_nothing() {
    let plain = Served::start(&["--threads", "2"]);
    let greedy = complete(&plain.addr, GREEDY);
    let sampled = complete(&plain.addr, SAMPLED);
    drop(plain);
    let model = common::default_model();
    let spec = Served::start(&["--threads", "2", "--draft-model", model.to_str().unwrap(), "--spec-tokens", "6"]);
    assert_eq!(complete(&spec.addr, GREEDY), greedy);
    let metrics = http(&spec.addr, "GET /metrics", "");
    let (proposed, accepted) = (counter(&metrics, "hearth_spec_draft_tokens_total"), counter(&metrics, "hearth_spec_accepted_tokens_total"));
    let (steps, tokens) = (counter(&metrics, "hearth_decode_sequence_steps_total"), counter(&metrics, "hearth_generated_tokens_total"));
    eprintln!("self-draft on one node: {tokens} tokens in {steps} steps; {accepted} of {proposed} drafts accepted");
    // Greedy drafts of the same weights are the target's own greedy choices. (How many it
    // drafts depends on this machine: a draft token costs about a decode step, a batch of
    // them verified together less than that many steps.)
    assert!(proposed > 0.0 && accepted == proposed, "{metrics}");
    assert_eq!(complete(&spec.addr, SAMPLED), sampled);
}

#[test]
fn a_draft_model_with_another_vocabulary_is_refused() {
    // The default model with one token's text changed ("Ġthe" -> "Ġthf"): same shapes,
    // other vocabulary.
    let dir = std::env::temp_dir().join(format!("hearth-spec-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let other = dir.join("other-vocab.gguf");
    let mut bytes = std::fs::read(common::default_model()).unwrap();
    let needle: Vec<u8> = [&5u64.to_le_bytes()[..], "\u{120}the".as_bytes()].concat();
    let at = bytes.windows(needle.len()).position(|w| w == needle).expect("the vocabulary has \"Ġthe\"");
    *bytes.get_mut(at + needle.len() - 1).unwrap() = b'f';
    std::fs::write(&other, bytes).unwrap();
    let err = match Served::try_start(&["--threads", "1", "--draft-model", other.to_str().unwrap()]) {
        Ok(_) => panic!("a draft model with another vocabulary was accepted"),
        Err(log) => log,
    };
    let _ = std::fs::remove_dir_all(&dir);
    assert!(err.contains("another vocabulary") && err.contains("other-vocab.gguf"), "{err}");
}

#[test]
fn a_draft_model_across_the_ring_gives_the_single_node_answer() {
    let single = Served::start(&["--threads", "1"]);
    let expected = complete(&single.addr, GREEDY);
    drop(single);
    let model = common::default_model();
    // Links of 20 ms a hop: a step is mostly waiting, a draft token cheap beside it.
    let hop = ["--emulate-hop-ms", "20"];
    let w1 = Served::worker(&["--threads", "1", hop[0], hop[1]]);
    let w2 = Served::worker(&["--threads", "1", hop[0], hop[1]]);
    let workers = format!("{},{}", w1.addr, w2.addr);
    let head = Served::start(&["--threads", "1", "--workers", &workers, "--windows", "10,10,10", "--draft-model", model.to_str().unwrap(), hop[0], hop[1]]);
    assert_eq!(complete(&head.addr, GREEDY), expected);
    let metrics = http(&head.addr, "GET /metrics", "");
    let (proposed, accepted) = (counter(&metrics, "hearth_spec_draft_tokens_total"), counter(&metrics, "hearth_spec_accepted_tokens_total"));
    let (steps, tokens) = (counter(&metrics, "hearth_decode_sequence_steps_total"), counter(&metrics, "hearth_generated_tokens_total"));
    eprintln!("self-draft on a slow ring: {tokens} tokens in {steps} steps; {accepted} of {proposed} drafts accepted");
    assert!(proposed > 0.0 && accepted == proposed, "{metrics}");
    assert!(steps < tokens / 3.0, "{steps} steps for {tokens} tokens");
    assert_eq!(complete(&head.addr, GREEDY), expected);
}
