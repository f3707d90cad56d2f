//! hearth's engine against llama.cpp (the high-level API on the same GGUF).

mod common;

use std::sync::Arc;

use engine::chat_template::ChatTemplate;
use engine::reference::{argmax, Reference};
use engine::tokenizer::Tokenizer;
use engine::{BatchToken, LocalPipeline, ModelFile, Stage, StageConfig};
use serde_json::json;

fn chat_prompt(tok: &Tokenizer, user: &str) -> Vec<i32> {
    let t = ChatTemplate::new(&tok.chat_template_source().expect("template"), &tok.bos_text(), &tok.eos_text()).unwrap();
    let text = t.render(&[json!({"role": "user", "content": user})], None, true).unwrap();
    tok.tokenize(&text, true)
}

fn pipeline(windows: &[std::ops::Range<usize>], n_seq: usize) -> LocalPipeline {
    let file = Arc::new(ModelFile::open(common::default_model()).unwrap());
    let stages = windows
        .iter()
        .map(|w| Stage::new(file.clone(), StageConfig { windows: vec![w.clone()], n_seq, n_ctx_seq: 1024, max_batch: 256, threads: common::THREADS, accel_layers: 0 }).unwrap())
        .collect();
    LocalPipeline::new(stages).unwrap()
}

fn rel_rms(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

#[test]
fn prompt_logits_match_llama_cpp() {
    let path = common::default_model();
    let tok = Tokenizer::load(&path).unwrap();
    let prompt = chat_prompt(&tok, "Name three colours of the rainbow and say why the sky is blue.");
    assert!((30..=60).contains(&prompt.len()), "prompt has {} tokens", prompt.len());
    let reference = Reference::load(&path, common::THREADS).unwrap().prompt_logits(&prompt).unwrap();

    let mut p = pipeline(&[0..30], 1);
    let batch: Vec<BatchToken> = (0..prompt.len()).map(|i| BatchToken { seq: 7, pos: i as u32, logits: true }).collect();
    let logits = p.forward(&batch, &prompt).unwrap();
    assert_eq!(logits.rows, (0..prompt.len()).collect::<Vec<_>>());
    let mut worst = 0f64;
    for (i, r) in reference.iter().enumerate() {
        let h = logits.row(i);
        assert_eq!(argmax(h), argmax(r), "argmax differs at position {i}");
        worst = worst.max(rel_rms(h, r));
    }
    eprintln!("worst relative RMS error over {} positions: {worst:.3e}", prompt.len());
    assert!(worst < 1e-2, "relative RMS error {worst}");
}
