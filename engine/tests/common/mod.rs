//! Shared by the engine's integration tests: the default model (fetched once by the
//! project's script), tiny random models, and small helpers.
#![allow(dead_code)]

pub mod tiny;

use std::path::PathBuf;
use std::sync::Arc;

use engine::chat_template::ChatTemplate;
use engine::tokenizer::Tokenizer;
use engine::reference::argmax;
use engine::{BatchToken, LocalPipeline, ModelFile, Stage, StageConfig};
use serde_json::json;

/// The default model, fetched by the project's script (test code may run processes; the
/// engine itself never does).
pub fn default_model() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = std::process::Command::new("bash").arg(root.join("scripts/fetch-model.sh")).env("HEARTH_MODELS_DIR", root.join("models")).output().expect("run scripts/fetch-model.sh");
    assert!(out.status.success(), "fetching the default model failed: {}", String::from_utf8_lossy(&out.stderr));
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// Threads per test: tests run in parallel on small machines, and oversubscribed ggml
/// thread pools spin each other to a crawl.
pub const THREADS: usize = 1;

/// A single-turn chat prompt rendered with the model's own template.
pub fn chat_prompt(tok: &Tokenizer, user: &str) -> Vec<i32> {
    let t = ChatTemplate::new(&tok.chat_template_source().expect("template"), &tok.bos_text(), &tok.eos_text()).unwrap();
    let text = t.render(&[json!({"role": "user", "content": user})], None, true).unwrap();
    tok.tokenize(&text, true)
}

pub fn stage_config(windows: Vec<std::ops::Range<usize>>, n_seq: usize) -> StageConfig {
    StageConfig { windows, n_seq, n_ctx_seq: 1024, max_batch: 256, threads: THREADS, accel_layers: 0, experts_in_ram: 0, owns_output: true, batch_invariant: false, repack: true, read_chosen_experts: false, kv: Default::default(), draft_snapshots: false }
}

/// One stage per window group, chained in layer order.
pub fn pipeline(path: &std::path::Path, stages: &[Vec<std::ops::Range<usize>>], n_seq: usize) -> LocalPipeline {
    pipeline_with(path, stages, n_seq, engine::CacheTypes::default())
}

/// [`pipeline`] with KV caches of types `kv`.
pub fn pipeline_with(path: &std::path::Path, stages: &[Vec<std::ops::Range<usize>>], n_seq: usize, kv: engine::CacheTypes) -> LocalPipeline {
    let file = Arc::new(ModelFile::open(path).unwrap());
    let stages = stages.iter().map(|w| Stage::new(file.clone(), StageConfig { kv, ..stage_config(w.clone(), n_seq) }).unwrap()).collect();
    LocalPipeline::new(stages).unwrap()
}

pub fn rel_rms(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Compares hearth's logits with llama.cpp's at every prompt position: same argmax
/// everywhere and relative RMS error below 1e-2. Returns the worst error.
pub fn assert_logits_match(path: &std::path::Path, prompt: &[i32]) -> f64 {
    use engine::reference::Reference;
    let reference = Reference::load(path, THREADS).unwrap().prompt_logits(prompt).unwrap();
    let spec = ModelFile::open(path).unwrap().spec;
    let mut p = pipeline(path, &[vec![0..spec.n_layer]], 1);
    let batch: Vec<BatchToken> = (0..prompt.len()).map(|i| BatchToken { seq: 7, pos: i as u32, logits: true }).collect();
    let logits = p.forward(&batch, prompt).unwrap();
    assert_eq!(logits.rows, (0..prompt.len()).collect::<Vec<_>>());
    let mut worst = 0f64;
    for (i, r) in reference.iter().enumerate() {
        let h = logits.row(i);
        assert_eq!(argmax(h), argmax(r), "argmax differs at position {i}");
        worst = worst.max(rel_rms(h, r));
    }
    assert!(worst < 1e-2, "relative RMS error {worst}");
    worst
}

/// Two prompts of real text sharing a long prefix (a ~1,800-byte part of docs/scheduler.md):
/// `a` asks a question after it, `b` goes on with the text; and the shared tokens' count.
pub fn prefix_prompts() -> (Vec<i32>, Vec<i32>, usize) {
    let tk = Tokenizer::load(&default_model()).unwrap();
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/scheduler.md")).unwrap();
    let cut = text.char_indices().map(|(i, _)| i).take_while(|&i| i < 1800).last().unwrap();
    let shared = tk.tokenize(&text[..cut], true);
    let a = [shared.clone(), tk.tokenize(" In one sentence: what does the scheduler solve?", false)].concat();
    let end = text.char_indices().map(|(i, _)| i).find(|&i| i >= cut + 500).unwrap();
    let b = [shared.clone(), tk.tokenize(&text[cut..end], false)].concat();
    (a, b, shared.len())
}

/// The first token from `logits` (a prompt of `len` tokens in `seq`) and 7 greedy after it.
pub fn greedy_after(p: &mut engine::LocalPipeline, seq: u64, len: usize, logits: &[f32]) -> Vec<i32> {
    let mut tokens = vec![argmax(logits)];
    for i in 0..7 {
        let l = p.forward(&[BatchToken { seq, pos: (len + i) as u32, logits: true }], &tokens[i..i + 1]).unwrap();
        tokens.push(argmax(l.row(0)));
    }
    tokens
}

/// Feeds `tokens` to `seq` in pieces of at most `MAX_PIECE` that start on whole tiles of
/// `TILE` rows and leave no rest under a tile (as the server's batcher cuts prompts);
/// returns the last token's logits.
pub fn feed(p: &mut engine::LocalPipeline, seq: u64, tokens: &[i32]) -> Vec<f32> {
    const TILE: usize = 64;
    const MAX_PIECE: usize = 256;
    let (mut at, mut last) = (0, Vec::new());
    while at < tokens.len() {
        let rest = tokens.len() - at;
        let take = if rest <= MAX_PIECE { rest } else if rest - MAX_PIECE < TILE { (rest - TILE) / TILE * TILE } else { MAX_PIECE };
        let base = p.sequence_len(seq);
        let batch: Vec<BatchToken> = (0..take).map(|i| BatchToken { seq, pos: (base + i) as u32, logits: i + 1 == take }).collect();
        last = p.forward(&batch, &tokens[at..at + take]).unwrap().row(0).to_vec();
        at += take;
    }
    last
}

/// Feeds `tokens` to `seq` in pieces of `piece` (the last one shorter); returns the last
/// token's logits.
pub fn feed_in(p: &mut engine::LocalPipeline, seq: u64, tokens: &[i32], piece: usize) -> Vec<f32> {
    let mut last = Vec::new();
    for part in tokens.chunks(piece) {
        let base = p.sequence_len(seq);
        let batch: Vec<BatchToken> = (0..part.len()).map(|i| BatchToken { seq, pos: (base + i) as u32, logits: i + 1 == part.len() }).collect();
        last = p.forward(&batch, part).unwrap().row(0).to_vec();
    }
    last
}
