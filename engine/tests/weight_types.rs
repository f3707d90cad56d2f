//! Every weight type through the engine against llama.cpp on one real model: the default
//! model requantized by llama.cpp's own quantizer into each type, greedy tokens compared
//! with llama.cpp's — with the CPU extra buffer types ("repacking", llama.cpp's default)
//! against llama.cpp's default, and without them against llama.cpp's `--no-repack`.

mod common;

use common::{chat_prompt, THREADS};
use engine::reference::{quantize, Reference};
use engine::tokenizer::Tokenizer;
use engine::{LocalPipeline, ModelFile, Stage};
use llama_cpp_sys_2 as sys;
use std::sync::Arc;

const PROMPTS: [&str; 2] = ["Name three colours of the rainbow and say why the sky is blue.", "Write a short poem about a cat who lives in a lighthouse."];
const GEN: usize = 48;

fn greedy(path: &std::path::Path, prompt: &[i32], repack: bool) -> Vec<i32> {
    let file = Arc::new(ModelFile::open(path).unwrap());
    let mut cfg = common::stage_config(vec![0..file.spec.n_layer], 1);
    cfg.repack = repack;
    let mut p = LocalPipeline::new(vec![Stage::new(file, cfg).unwrap()]).unwrap();
    p.greedy(0, prompt, GEN, 512).unwrap()
}

fn check(name: &str, ftype: u32) {
    let src = common::default_model();
    let dir = std::env::temp_dir().join(format!("hearth-types-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("default-{name}.gguf"));
    quantize(&src, &path, ftype, 2).unwrap();
    let tok = Tokenizer::load(&path).unwrap();
    let with = Reference::load_with(&path, THREADS, true).unwrap();
    let without = Reference::load_with(&path, THREADS, false).unwrap();
    for (i, text) in PROMPTS.iter().enumerate() {
        let prompt = chat_prompt(&tok, text);
        assert_eq!(greedy(&path, &prompt, true), with.greedy(&prompt, GEN).unwrap(), "{name}, prompt {i}: repacked weights differ from llama.cpp's default");
        assert_eq!(greedy(&path, &prompt, false), without.greedy(&prompt, GEN).unwrap(), "{name}, prompt {i}: plain weights differ from llama.cpp --no-repack");
    }
    // Formats whose odd row counts hearth pads (graph.rs `mul_mat_acc`): every product of
    // the model, not only the output layer's, gets a zero row, and the logits of every
    // row kept are llama.cpp's to the bit.
    if matches!(name, "q8_0" | "q5_0") {
        let prompt = chat_prompt(&tok, PROMPTS[0]);
        for n in [3, 7, 29] {
            let worst = common::assert_logits_match(&path, &prompt[..n]);
            assert_eq!(worst, 0.0, "{name}, {n} rows: relative RMS error {worst:e}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

macro_rules! weight_types {
    ($($test:ident: $name:literal = $ftype:ident;)*) => {$(
        #[test]
        fn $test() {
            check($name, sys::$ftype as u32);
        }
    )*};
}

weight_types! {
    f16_matches_llama_cpp: "f16" = LLAMA_FTYPE_MOSTLY_F16;
    bf16_matches_llama_cpp: "bf16" = LLAMA_FTYPE_MOSTLY_BF16;
    q8_0_matches_llama_cpp: "q8_0" = LLAMA_FTYPE_MOSTLY_Q8_0;
    q4_0_matches_llama_cpp: "q4_0" = LLAMA_FTYPE_MOSTLY_Q4_0;
    q5_0_matches_llama_cpp: "q5_0" = LLAMA_FTYPE_MOSTLY_Q5_0;
    q5_1_matches_llama_cpp: "q5_1" = LLAMA_FTYPE_MOSTLY_Q5_1;
    q2_k_matches_llama_cpp: "q2_k" = LLAMA_FTYPE_MOSTLY_Q2_K;
    q3_k_m_matches_llama_cpp: "q3_k_m" = LLAMA_FTYPE_MOSTLY_Q3_K_M;
    q4_k_m_matches_llama_cpp: "q4_k_m" = LLAMA_FTYPE_MOSTLY_Q4_K_M;
    q5_k_m_matches_llama_cpp: "q5_k_m" = LLAMA_FTYPE_MOSTLY_Q5_K_M;
    q6_k_matches_llama_cpp: "q6_k" = LLAMA_FTYPE_MOSTLY_Q6_K;
    iq4_nl_matches_llama_cpp: "iq4_nl" = LLAMA_FTYPE_MOSTLY_IQ4_NL;
    iq4_xs_matches_llama_cpp: "iq4_xs" = LLAMA_FTYPE_MOSTLY_IQ4_XS;
    iq3_s_matches_llama_cpp: "iq3_s" = LLAMA_FTYPE_MOSTLY_IQ3_S;
}
