//! hearth's engine against llama.cpp (its high-level API on the same GGUF): logits,
//! greedy generation, windows, interleaved sequences, and tiny models of the other
//! architectures.

mod common;

use std::ops::Range;

use common::{chat_prompt, pipeline, THREADS};
use engine::gguf::Value;
use engine::random_model::RandomModel;
use engine::reference::{argmax, Reference};
use engine::tokenizer::Tokenizer;
use engine::BatchToken;

const PROMPTS: [&str; 3] = [
    "Name three colours of the rainbow and say why the sky is blue.",
    "Write a short poem about a cat who lives in a lighthouse.",
    "Explain in detail how a bicycle works.",
];
const GEN: usize = 128;
/// Greedy tokens compared on the tiny models.
const TINY_GEN: usize = 64;

fn windows(ws: &[Range<usize>]) -> Vec<Vec<Range<usize>>> {
    ws.iter().map(|w| vec![w.clone()]).collect()
}

#[test]
fn prompt_logits_match_llama_cpp() {
    let path = common::default_model();
    let tok = Tokenizer::load(&path).unwrap();
    let prompt = chat_prompt(&tok, PROMPTS[0]);
    assert!((30..=60).contains(&prompt.len()), "prompt has {} tokens", prompt.len());
    let worst = common::assert_logits_match(&path, &prompt);
    eprintln!("default model: worst relative RMS error over {} positions {worst:.3e}", prompt.len());
    // Odd row counts: hearth pads the output layer's Q8_0 product by a zero row (graph.rs
    // `mul_mat_acc`), llama.cpp does not; every kept row is still bit-identical.
    for n in [3, 5, 7, 31] {
        let worst = common::assert_logits_match(&path, &prompt[..n]);
        assert_eq!(worst, 0.0, "{n} rows: relative RMS error {worst:e}");
    }
}

#[test]
fn greedy_generation_matches_llama_cpp_and_survives_cutting_into_windows() {
    let path = common::default_model();
    let tok = Tokenizer::load(&path).unwrap();
    let reference = Reference::load(&path, THREADS).unwrap();
    let mut whole = pipeline(&path, &windows(&[0..30]), 1);
    // Uneven windows on three stages, hidden states handed over by value.
    let mut cut = pipeline(&path, &windows(&[0..7, 7..22, 22..30]), 1);
    // One stage owning two disjoint windows (as the ring gives a device), another the rest.
    let mut split = pipeline(&path, &[vec![0..5, 15..20], vec![5..15, 20..30]], 1);
    for (i, text) in PROMPTS.iter().enumerate() {
        let prompt = chat_prompt(&tok, text);
        let expected = reference.greedy(&prompt, GEN).unwrap();
        let got = whole.greedy(0, &prompt, GEN, 512).unwrap();
        assert_eq!(got, expected, "prompt {i}: hearth's greedy tokens differ from llama.cpp's");
        assert_eq!(cut.greedy(0, &prompt, GEN, 512).unwrap(), expected, "prompt {i}: 3 windows differ");
        assert_eq!(split.greedy(0, &prompt, GEN, 512).unwrap(), expected, "prompt {i}: disjoint windows differ");
        eprintln!("prompt {i}: {:?}", tok.detokenize(&got[..24]));
    }
}

/// A split set (written as llama.cpp's gguf-split writes one, here in parts of about a
/// quarter of the model): hearth opens it from any part as one model whose logits are the
/// same model's in one file, bit for bit, and llama.cpp's on the split set; windows whose
/// layers lie in two parts give the same greedy tokens as llama.cpp.
#[test]
fn a_split_model_computes_what_the_model_in_one_file_and_llama_cpp_on_the_split_set_compute() {
    use engine::ModelFile;
    let path = common::default_model();
    let single = ModelFile::open(&path).unwrap();
    let dir = std::env::temp_dir().join(format!("hearth-split-oracle-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prefix = dir.join("default").to_string_lossy().into_owned();
    let parts = engine::gguf::split::write_split(&single.gguf, &prefix, single.gguf.bytes().len() as u64 / 4).unwrap();
    assert!(parts.len() >= 4, "{parts:?}");
    let split = ModelFile::open(&parts[0]).unwrap();
    assert_eq!(split.gguf.parts().len(), parts.len());
    assert_eq!(split.gguf.tensors().len(), single.gguf.tensors().len());
    for t in single.gguf.tensors() {
        let s = split.gguf.tensor(&t.name).unwrap();
        assert!(split.gguf.tensor_bytes(s) == single.gguf.tensor_bytes(t), "tensor {} differs in the split set", t.name);
    }
    // Named by another part, the same set opens.
    let from_third = ModelFile::open(&parts[2]).unwrap();
    assert_eq!(from_third.gguf.path(), parts[0].as_path());
    assert_eq!(from_third.fingerprint(), split.fingerprint());
    assert_ne!(split.fingerprint(), single.fingerprint(), "a split set is other files to ship than the model in one file");
    // A layer whose tensors lie in two parts: a window boundary there.
    let part_of = |name: &str| {
        let t = split.gguf.tensor(name).unwrap();
        let at = (split.gguf.data_offset() + t.offset) as usize;
        split.gguf.parts().iter().position(|p| (p.base() as usize..(p.base() + p.len()) as usize).contains(&at)).unwrap()
    };
    let n_layer = split.spec.n_layer;
    let parts_of = |l: usize| -> std::collections::BTreeSet<usize> {
        split.gguf.tensors().iter().filter(|t| t.name.starts_with(&format!("blk.{l}."))).map(|t| part_of(&t.name)).collect()
    };
    let crossing = (0..n_layer).find(|&l| parts_of(l).len() > 1).expect("a layer split between two parts");

    let tok = Tokenizer::load(&parts[0]).unwrap();
    let prompt = chat_prompt(&tok, PROMPTS[1]);
    let positions: Vec<BatchToken> = (0..prompt.len()).map(|i| BatchToken { seq: 3, pos: i as u32, logits: true }).collect();
    let one = common::pipeline(&path, &windows(&[0..n_layer]), 1).forward(&positions, &prompt).unwrap();
    let mut whole = common::pipeline(&parts[0], &windows(&[0..n_layer]), 1);
    let logits = whole.forward(&positions, &prompt).unwrap();
    let reference_single = Reference::load(&path, THREADS).unwrap().prompt_logits(&prompt).unwrap();
    let reference = Reference::load(&parts[0], THREADS).unwrap();
    let expected = reference.prompt_logits(&prompt).unwrap();
    assert_eq!(expected, reference_single, "llama.cpp reads the split set as the model in one file");
    let mut worst = 0f64;
    for (i, r) in expected.iter().enumerate() {
        assert_eq!(logits.row(i), one.row(i), "position {i}: the split set's logits are not the single file's");
        assert_eq!(argmax(logits.row(i)), argmax(r), "position {i}: argmax differs from llama.cpp on the split set");
        worst = worst.max(common::rel_rms(logits.row(i), r));
    }
    assert!(worst < 1e-2, "relative RMS error against llama.cpp on the split set {worst}");
    let greedy = reference.greedy(&prompt, GEN).unwrap();
    let mut cut = common::pipeline(&parts[0], &windows(&[0..crossing, crossing..crossing + 1, crossing + 1..n_layer]), 1);
    assert_eq!(cut.greedy(0, &prompt, GEN, 512).unwrap(), greedy, "windows at the part boundary (layer {crossing}) differ from llama.cpp");
    eprintln!("{} parts, layer {crossing} in two of them; worst relative RMS error against llama.cpp {worst:.2e}", parts.len());
    std::fs::remove_dir_all(&dir).ok();
}

/// Quantized and other KV cache types (llama.cpp's `--cache-type-k/-v`): every type, K
/// and V mixed, gives llama.cpp's logits at every prompt position and its greedy tokens
/// with the same types, whole and cut into two stages; and the type is really used (a
/// quantized cache's logits are not F16's).
#[test]
fn every_kv_cache_type_matches_llama_cpp_with_the_same_types() {
    use engine::{CacheType as T, CacheTypes};
    let path = common::default_model();
    let tok = Tokenizer::load(&path).unwrap();
    let prompt = chat_prompt(&tok, PROMPTS[2]);
    let positions: Vec<BatchToken> = (0..prompt.len()).map(|i| BatchToken { seq: 3, pos: i as u32, logits: true }).collect();
    let f16 = Reference::load(&path, THREADS).unwrap().prompt_logits(&prompt).unwrap();
    for (k, v) in [(T::Q8_0, T::Q8_0), (T::Q4_0, T::Q4_0), (T::Q8_0, T::Q4_0), (T::Bf16, T::Q5_1), (T::Q4_1, T::Iq4Nl), (T::F32, T::Q5_0)] {
        let kv = CacheTypes { k, v };
        let reference = Reference::load(&path, THREADS).unwrap().with_cache_types(kv);
        let expected_logits = reference.prompt_logits(&prompt).unwrap();
        let mut whole = common::pipeline_with(&path, &windows(&[0..30]), 1, kv);
        let logits = whole.forward(&positions, &prompt).unwrap();
        let mut worst = 0f64;
        for (i, r) in expected_logits.iter().enumerate() {
            worst = worst.max(common::rel_rms(logits.row(i), r));
        }
        assert!(worst < 1e-2, "K {k}, V {v}: relative RMS error {worst}");
        let last = prompt.len() - 1;
        let from_f16 = common::rel_rms(logits.row(last), &f16[last]);
        if k != T::F32 || v != T::F32 {
            assert!(from_f16 > 0.0, "K {k}, V {v}: the logits are F16's: the cache type was not used");
        }
        whole.clear_sequence(3);
        let expected = reference.greedy(&prompt, GEN).unwrap();
        assert_eq!(whole.greedy(0, &prompt, GEN, 512).unwrap(), expected, "K {k}, V {v}: greedy tokens differ from llama.cpp's");
        let mut cut = common::pipeline_with(&path, &windows(&[0..12, 12..30]), 1, kv);
        assert_eq!(cut.greedy(0, &prompt, GEN, 512).unwrap(), expected, "K {k}, V {v}: two stages differ");
        eprintln!("K {k}, V {v}: worst relative RMS error against llama.cpp {worst:.2e}, last position against F16 {from_f16:.2e}");
    }
}

#[test]
fn interleaved_sequences_give_the_same_tokens_as_each_alone() {
    let path = common::default_model();
    let tok = Tokenizer::load(&path).unwrap();
    let prompts: Vec<Vec<i32>> = PROMPTS[..2].iter().map(|t| chat_prompt(&tok, t)).collect();
    let mut alone = pipeline(&path, &windows(&[0..30]), 1);
    let expected: Vec<Vec<i32>> = prompts.iter().map(|p| alone.greedy(0, p, 64, 512).unwrap()).collect();

    let mut p = pipeline(&path, &windows(&[0..12, 12..30]), 2);
    let (a, b) = (100u64, 200u64);
    // Both prompts in one batch, their tokens interleaved one by one.
    let mut batch = Vec::new();
    let mut ids = Vec::new();
    for i in 0..prompts[0].len().max(prompts[1].len()) {
        for (seq, pr) in [(a, &prompts[0]), (b, &prompts[1])] {
            if i < pr.len() {
                batch.push(BatchToken { seq, pos: i as u32, logits: i + 1 == pr.len() });
                ids.push(pr[i]);
            }
        }
    }
    let logits = p.forward(&batch, &ids).unwrap();
    assert_eq!(logits.rows.len(), 2);
    let mut next = [argmax(logits.row(0)), argmax(logits.row(1))];
    // Which row is which: rows come back in batch order.
    if batch[logits.rows[0]].seq != a {
        next.swap(0, 1);
    }
    let mut got = [vec![next[0]], vec![next[1]]];
    for step in 1..64 {
        // One decode token per sequence each step, b first to vary the order.
        let batch = [
            BatchToken { seq: b, pos: (prompts[1].len() + step - 1) as u32, logits: true },
            BatchToken { seq: a, pos: (prompts[0].len() + step - 1) as u32, logits: true },
        ];
        let l = p.forward(&batch, &[got[1][step - 1], got[0][step - 1]]).unwrap();
        assert_eq!(l.rows, vec![0, 1]);
        got[1].push(argmax(l.row(0)));
        got[0].push(argmax(l.row(1)));
    }
    assert_eq!(got[0], expected[0], "sequence a differs when batched with b");
    assert_eq!(got[1], expected[1], "sequence b differs when batched with a");
}

/// Sequences decoding together, one token each per step as llama-server's slots decode:
/// hearth attends them with one op per layer (a cache slot each) as llama.cpp attends its
/// streams, and every sequence's greedy tokens equal llama.cpp's — whole and cut into two
/// stages. The prompts differ in length, and one crosses 256 cells while decoding, so the
/// sequences sharing an op attend different lengths (the shorter ones' masks hide the rest).
#[test]
fn sequences_decoding_together_match_llama_cpps_streams() {
    let path = common::default_model();
    let tok = Tokenizer::load(&path).unwrap();
    let text = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/prima-cpp-excerpt.txt")).unwrap();
    let passage: String = text.chars().take(800).collect();
    let mut prompts: Vec<Vec<i32>> = PROMPTS.iter().map(|t| chat_prompt(&tok, t)).collect();
    prompts.push(chat_prompt(&tok, &format!("Summarise this:\n\n{passage}")));
    // One batch each (the stages hold 256 tokens a batch), as llama.cpp feeds them.
    assert!(prompts[3].len() <= 256 && prompts[3].len() + 48 > 256, "{:?}", prompts.iter().map(Vec::len).collect::<Vec<_>>());
    let (expected, _) = Reference::load(&path, THREADS).unwrap().decode_together(&prompts, 48, true).unwrap();
    for stages in [windows(&[0..30]), windows(&[0..12, 12..30])] {
        let (got, _) = pipeline(&path, &stages, prompts.len()).decode_together(&prompts, 48, 256).unwrap();
        for (s, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(g, e, "sequence {s} ({} prompt tokens) differs from llama.cpp's stream, {} stages", prompts[s].len(), stages.len());
        }
    }
    // Three at once: an odd row count, which hearth pads by a zero row for the output
    // layer's Q8_0 product (graph.rs `mul_mat_acc`); the rows kept must not change.
    let three = &prompts[1..];
    let (expected, _) = Reference::load(&path, THREADS).unwrap().decode_together(three, 48, true).unwrap();
    let (got, _) = pipeline(&path, &windows(&[0..30]), three.len()).decode_together(three, 48, 256).unwrap();
    for (s, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(g, e, "sequence {s} of three differs from llama.cpp's stream");
    }
}

/// Sliding-window layers with sequences sharing their attention op: three sequences of
/// 20, ~90 and ~300 prompt tokens decode together on a tiny model whose window is 8, so
/// the longest one's window starts past the first 256 cells while the others' start at 0
/// (the shared op attends from the earliest start; each mask hides the rest). Greedy
/// tokens equal llama.cpp's streams (its sliding cache full-size, cells as hearth's).
fn tiny_together(mut m: RandomModel) {
    let arch = m.arch.clone();
    m.n_swa = 8;
    let dir = std::env::temp_dir().join(format!("hearth-tiny-together-{}-{arch}-{}", std::process::id(), m.seed));
    std::fs::create_dir_all(&dir).unwrap();
    let path = common::tiny::write(&m, &dir);
    let tok = Tokenizer::load(&path).unwrap();
    let text = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/prima-cpp-excerpt.txt")).unwrap();
    let all = tok.tokenize(&text.chars().take(2_000).collect::<String>(), false);
    assert!(all.len() > 300, "{} tokens", all.len());
    let prompts: Vec<Vec<i32>> = [20, 90, 300].iter().map(|&n| all[..n].to_vec()).collect();
    let (expected, _) = Reference::load(&path, THREADS).unwrap().decode_together(&prompts, 32, true).unwrap();
    let file = std::sync::Arc::new(engine::ModelFile::open(&path).unwrap());
    // Each prompt in one batch, as llama.cpp feeds it.
    let cfg = engine::StageConfig { max_batch: 512, ..common::stage_config(vec![0..m.n_layer as usize], prompts.len()) };
    let mut p = engine::LocalPipeline::new(vec![engine::Stage::new(file, cfg).unwrap()]).unwrap();
    let (got, _) = p.decode_together(&prompts, 32, 512).unwrap();
    for (s, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(g, e, "{arch}: sequence {s} ({} prompt tokens) differs from llama.cpp's stream", prompts[s].len());
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn tiny_gemma3_sequences_decoding_together_match_llama_cpps_streams() {
    let mut m = common::tiny::model("gemma3");
    m.head_dim = Some(32);
    m.extra = vec![("attention.sliding_window_pattern".into(), Value::U32(2)), ("rope.freq_base_swa".into(), Value::F32(10_000.0))];
    tiny_together(m);
}

#[test]
fn tiny_gpt_oss_sequences_decoding_together_match_llama_cpps_streams() {
    tiny_together(common::tiny::model("gpt-oss"));
}

/// A tiny model of `m`'s architecture against llama.cpp: logits at every position of
/// a prompt longer than the sliding window where there is one, greedy tokens whole and
/// cut into three windows and into disjoint windows on two stages.
fn tiny(m: RandomModel) {
    let arch = m.arch.clone();
    // One folder per call: tests of one arch run in parallel and each removes its own.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("hearth-tiny-{}-{arch}-{call}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = common::tiny::write(&m, &dir);
    let tok = Tokenizer::load(&path).unwrap();
    let prompt = tok.tokenize("The small model reads a sentence of about forty tokens, long enough for attention to mix several positions, and for rotary embeddings to matter at each one of them in turn.", false);
    assert!(prompt.len() >= 30, "{} tokens", prompt.len());
    let worst = common::assert_logits_match(&path, &prompt);
    eprintln!("{arch}: worst relative RMS error {worst:.3e}");
    let expected = Reference::load(&path, THREADS).unwrap().greedy(&prompt, TINY_GEN).unwrap();
    let n = m.n_layer as usize;
    let mut whole = pipeline(&path, &windows(&[0..n]), 1);
    assert_eq!(whole.greedy(1, &prompt, TINY_GEN, 512).unwrap(), expected, "{arch}: greedy tokens differ from llama.cpp's");
    let mut cut = pipeline(&path, &windows(&[0..1, 1..2, 2..n]), 1);
    assert_eq!(cut.greedy(1, &prompt, TINY_GEN, 512).unwrap(), expected, "{arch}: three windows differ");
    let mut split = pipeline(&path, &[vec![0..1, 2..n], vec![1..2]], 1);
    assert_eq!(split.greedy(1, &prompt, TINY_GEN, 512).unwrap(), expected, "{arch}: disjoint windows differ");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn tiny_qwen2_with_qkv_bias_matches_llama_cpp() {
    tiny(common::tiny::model("qwen2"));
}

#[test]
fn tiny_qwen3_with_qk_norm_and_tied_output_matches_llama_cpp() {
    let mut m = common::tiny::model("qwen3");
    m.tied_output = true;
    tiny(m);
}

#[test]
fn tiny_mistral_with_attention_temperature_matches_llama_cpp() {
    let mut m = common::tiny::model("mistral3");
    m.extra = vec![("attention.temperature_scale".into(), Value::F32(0.1)), ("rope.scaling.original_context_length".into(), Value::U32(8))];
    tiny(m);
}

#[test]
fn tiny_llama_untied_matches_llama_cpp() {
    tiny(common::tiny::model("llama"));
}

/// The random Q4_K_M mix (`hearth make-model --type q4_k_m`, the journey's 70B-shaped
/// model): Q4_K and Q6_K blocks written by hand decode to finite, varied logits, and
/// hearth computes what llama.cpp computes on them. Rows of 256 (the K-quants' block).
#[test]
fn tiny_llama_in_the_random_q4_k_m_mix_matches_llama_cpp() {
    let mut m = RandomModel::new("llama", 3, 256, 512, 4, 2);
    m.ty = engine::gguf::GgmlType::Q4_K;
    m.context_length = 2048;
    m.seed = 5;
    let dir = std::env::temp_dir().join(format!("hearth-tiny-q4km-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = common::tiny::write(&m, &dir);
    let file = engine::ModelFile::open(&path).unwrap();
    let types: std::collections::BTreeSet<String> = file.gguf.tensors().iter().map(|t| t.ty.to_string()).collect();
    assert!(types.contains("q4_K") && types.contains("q6_K"), "{types:?}");
    assert_eq!(file.gguf.get_u64("general.file_type"), Some(15));
    drop(file);
    let tok = Tokenizer::load(&path).unwrap();
    let logits = Reference::load(&path, THREADS).unwrap().prompt_logits(&tok.tokenize("A few words of text.", false)).unwrap();
    let last = logits.last().unwrap();
    let mean = last.iter().map(|&x| x as f64).sum::<f64>() / last.len() as f64;
    let std = (last.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / last.len() as f64).sqrt();
    assert!(last.iter().all(|x| x.is_finite()) && std > 0.1, "the logits are not finite and varied: std {std}");
    std::fs::remove_dir_all(&dir).ok();
    tiny(m);
}

#[test]
fn tiny_qwen3moe_routes_experts_as_llama_cpp() {
    tiny(common::tiny::model("qwen3moe"));
}

#[test]
fn tiny_qwen3moe_with_q8_0_weights_and_one_expert_per_token_matches_llama_cpp() {
    let mut m = common::tiny::model("qwen3moe");
    m.ty = engine::gguf::GgmlType::Q8_0;
    m.n_expert_used = 1;
    // Not read for qwen3moe by llama.cpp, nor by hearth.
    m.extra = vec![("expert_weights_scale".into(), Value::F32(2.5))];
    tiny(m);
}

#[test]
fn tiny_llama4_with_nope_layers_interleaved_experts_and_a_shared_expert_matches_llama_cpp() {
    tiny(common::tiny::model("llama4"));
}

/// Gemma 4's MoE model (26B-A4B's block): sliding layers of head size 16 with 2 KV heads,
/// full layers of 32 with 1 and V taken from K, proportional RoPE, a window of 8 under the
/// 40-token prompt, the dense FFN beside GELU experts stacked gate-and-up with per-expert
/// output scales, a scale on every layer's output, the logits soft-capped.
#[test]
fn tiny_gemma4_moe_with_its_own_head_sizes_per_layer_kind_matches_llama_cpp() {
    let mut m = common::tiny::model("gemma4");
    m.n_swa = 8;
    tiny(m);
}

/// Gemma 4's dense model (31B's block).
#[test]
fn tiny_gemma4_dense_matches_llama_cpp() {
    let mut m = common::tiny::model("gemma4");
    m.n_swa = 8;
    m.n_expert = 0;
    m.n_expert_used = 0;
    tiny(m);
}

#[test]
fn tiny_gemma4_sequences_decoding_together_match_llama_cpps_streams() {
    tiny_together(common::tiny::model("gemma4"));
}

/// Gemma 4 with a prompt of real text near its context limit (3,900 of 4,096 tokens, the
/// window 8): the last logits whole, in three windows and in two, against llama.cpp's; then
/// with a q8_0 K and q4_0 V cache, which llama.cpp rotates by Walsh-Hadamard matrices of
/// each layer kind's head size (64 sliding, 128 full: two rotations in one graph).
#[test]
fn tiny_gemma4_near_its_context_limit_and_with_quantized_caches_matches_llama_cpp() {
    let mut m = common::tiny::model("gemma4");
    m.n_swa = 8;
    m.head_dim = Some(64);
    m.context_length = 4096;
    let q = engine::CacheTypes { k: engine::CacheType::Q8_0, v: engine::CacheType::Q4_0 };
    let path = long_prompt_matches(&m, 3_900, &[engine::CacheTypes::default(), q], &[windows(&[0..3]), windows(&[0..1, 1..2, 2..3]), windows(&[0..2, 2..3])], 512);
    std::fs::remove_dir_all(path.parent().unwrap()).ok();
}

/// Gemma 4 E2B/E4B's block, in six layers (full every third): every layer adds its own
/// input (a lookup per token plus a projection of the embedding, gated by the residual
/// stream), and the last three keep no K/V, attending with layer 1's (sliding) and layer
/// 2's (full) cache, with FFNs twice as wide.
fn tiny_gemma4_e() -> RandomModel {
    let mut m = common::tiny::model("gemma4");
    (m.n_layer, m.full_every, m.per_layer_embd, m.shared_kv_layers) = (6, 3, 32, 3);
    (m.n_expert, m.n_expert_used, m.n_swa) = (0, 0, 8);
    // Its own files beside the other Gemma 4 tests' (paths are named by the seed).
    m.seed = 44;
    m
}

/// Logits and greedy tokens as llama.cpp's, whole and cut into windows anywhere: between a
/// donor and the layers that share its cache (a window then keeps its own copy of the
/// donor's cache, written from the K/V the hidden states carry), between shared layers,
/// in disjoint windows on two stages, and from an embedding-only window.
#[test]
fn tiny_gemma4_e_with_per_layer_inputs_and_shared_kv_matches_llama_cpp() {
    let m = tiny_gemma4_e();
    tiny(m.clone());
    let dir = std::env::temp_dir().join(format!("hearth-tiny-gemma4-e-cuts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = common::tiny::write(&m, &dir);
    let tok = Tokenizer::load(&path).unwrap();
    let prompt = tok.tokenize("A phone, a laptop and a desktop share one model: each keeps the layers it was given, and the hidden states travel between them.", false);
    let expected = Reference::load(&path, THREADS).unwrap().greedy(&prompt, TINY_GEN).unwrap();
    let shapes: Vec<Vec<Vec<Range<usize>>>> = vec![
        windows(&[0..3, 3..4, 4..6]),
        windows(&[0..1, 1..5, 5..6]),
        windows(&[0..0, 0..2, 2..6]),
        vec![vec![0..2, 4..6], vec![2..4]],
        vec![vec![0..1, 3..6], vec![1..3]],
    ];
    let want = Reference::load(&path, THREADS).unwrap().last_logits(&prompt, 512).unwrap();
    for stages in &shapes {
        let got = pipeline(&path, stages, 1).prefill(1, &prompt, 512).unwrap();
        let err = common::rel_rms(&got, &want);
        assert!(err < 1e-6, "gemma4 E: {stages:?}: the last logits' relative RMS error is {err}");
        let mut p = pipeline(&path, stages, 1);
        assert_eq!(p.greedy(1, &prompt, TINY_GEN, 512).unwrap(), expected, "gemma4 E: {stages:?} differs from llama.cpp");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A Gemma 4 file whose shared-K/V count or per-layer FFN widths do not fit its layers is
/// refused at load with what is wrong, never computed.
#[test]
fn gemma4_e_files_that_do_not_fit_their_layers_are_refused() {
    let dir = std::env::temp_dir().join(format!("hearth-tiny-gemma4-e-refused-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cases: [(&str, Value, &str); 3] = [
        // Layers 4 and 5 would share: two before them, layer 2, is a full layer.
        ("attention.shared_kv_layers", Value::U32(2), "sliding layer (2) then a full one (3)"),
        ("attention.shared_kv_layers", Value::U32(5), "fewer than the 6 layers"),
        ("feed_forward_length", Value::Array { elem: engine::gguf::ValueType::U32, items: vec![Value::U32(160); 4] }, "one width in"),
    ];
    for (i, (key, value, why)) in cases.into_iter().enumerate() {
        let mut m = tiny_gemma4_e();
        m.seed = 100 + i as u64;
        m.extra = vec![(key.into(), value)];
        let path = common::tiny::write(&m, &dir);
        let err = engine::ModelFile::open(&path).err().unwrap_or_else(|| panic!("{key}: loaded")).to_string();
        assert!(err.contains(why), "{key}: {err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn tiny_gemma4_e_sequences_decoding_together_match_llama_cpps_streams() {
    tiny_together(tiny_gemma4_e());
}

/// Gemma 4 E near its context limit (3,900 tokens of real text, the window 8), with the
/// default cache and a q8_0/q4_0 one (the carried K/V are the rotated values the donor
/// writes), whole and cut between the donors and the shared layers.
#[test]
fn tiny_gemma4_e_near_its_context_limit_and_with_quantized_caches_matches_llama_cpp() {
    let mut m = tiny_gemma4_e();
    m.head_dim = Some(64);
    m.context_length = 4096;
    let q = engine::CacheTypes { k: engine::CacheType::Q8_0, v: engine::CacheType::Q4_0 };
    let path = long_prompt_matches(&m, 3_900, &[engine::CacheTypes::default(), q], &[windows(&[0..6]), windows(&[0..2, 2..4, 4..6])], 512);
    std::fs::remove_dir_all(path.parent().unwrap()).ok();
}

/// DeepSeek 2's block (V3, R1, GLM-4.7-Flash): latent attention with a low-rank query,
/// the queries absorbed into the compressed space and one cached row per token, a dense
/// first layer, sigmoid-routed experts with a selection bias, normalised and scaled
/// weights, and a shared expert.
#[test]
fn tiny_deepseek2_with_latent_attention_matches_llama_cpp() {
    tiny(common::tiny::model("deepseek2"));
}

/// DeepSeek's Lite form (V2-Lite, Kanana-2): a plain query projection, no low-rank one.
/// llama.cpp tells it by the layer count (26 or 27), so the model has 26.
#[test]
fn tiny_deepseek2_lite_with_a_plain_query_matches_llama_cpp() {
    let mut m = common::tiny::model("deepseek2");
    m.n_layer = 26;
    m.mla_lite = true;
    tiny(m);
}

/// DeepSeek V3's context extension: YaRN with a factor of 40 over 4,096 original
/// positions and its log multiplier (the file's 0.1, which llama.cpp divides by 0.1), which
/// pre-scale the attention scores by YaRN's magnitude squared; the prompt runs past the
/// model's original context so the extension's ramp matters.
#[test]
fn tiny_deepseek2_with_yarn_context_extension_matches_llama_cpp() {
    let mut m = common::tiny::model("deepseek2");
    m.extra = vec![
        ("rope.scaling.type".into(), Value::String("yarn".into())),
        ("rope.scaling.factor".into(), Value::F32(40.0)),
        ("rope.scaling.original_context_length".into(), Value::U32(64)),
        ("rope.scaling.yarn_log_multiplier".into(), Value::F32(0.1)),
    ];
    tiny(m);
}

/// DeepSeek V3's group-limited routing: 8 experts in 4 groups, the best 2 groups' experts
/// compete.
#[test]
fn tiny_deepseek2_with_expert_groups_matches_llama_cpp() {
    let mut m = common::tiny::model("deepseek2");
    m.extra = vec![("expert_group_count".into(), Value::U32(4)), ("expert_group_used_count".into(), Value::U32(2))];
    tiny(m);
}

#[test]
fn tiny_deepseek2_sequences_decoding_together_match_llama_cpps_streams() {
    tiny_together(common::tiny::model("deepseek2"));
}

/// DeepSeek 2 with a prompt of real text near its context limit (3,900 of 4,096), whole and
/// in windows, with an F16 cache and a q8_0 one (V is read from the K rows, so the V type
/// has K's type, as in llama.cpp, which refuses two types; so does hearth).
#[test]
fn tiny_deepseek2_near_its_context_limit_and_with_a_quantized_cache_matches_llama_cpp() {
    let mut m = common::tiny::model("deepseek2");
    m.context_length = 4096;
    // Rows of 128 + 32 (compressed K/V + rotated part): whole q8_0 blocks.
    m.head_dim = Some(32);
    let q = engine::CacheTypes { k: engine::CacheType::Q8_0, v: engine::CacheType::Q8_0 };
    let path = long_prompt_matches(&m, 3_900, &[engine::CacheTypes::default(), q], &[windows(&[0..3]), windows(&[0..1, 1..2, 2..3])], 512);
    let mixed = engine::CacheTypes { k: engine::CacheType::Q8_0, v: engine::CacheType::F16 };
    let err = engine::Stage::new(std::sync::Arc::new(engine::ModelFile::open(&path).unwrap()), engine::StageConfig { kv: mixed, ..common::stage_config(vec![0..3], 1) }).err().expect("K and V types differ").to_string();
    assert!(err.contains("one cache type"), "{err}");
    std::fs::remove_dir_all(path.parent().unwrap()).ok();
}

/// Llama 4 past its first attention chunk: at 8,192 positions its rotating layers start a
/// new chunk (attending only within it) and its NoPE layers' query temperature rises above
/// 1, neither of which a shorter prompt reaches. The logits after a ~8,400-token prompt of
/// real text, whole and in three windows, against llama.cpp's.
#[test]
fn tiny_llama4_past_its_first_attention_chunk_matches_llama_cpp() {
    let mut m = common::tiny::model("llama4");
    m.context_length = 16_384;
    // The last window holds the NoPE layer alone: a graph that reads no positions.
    // Measured 0 (the same graph as llama.cpp's); leaving out the NoPE layers' temperature
    // alone moves it to 7.5e-3, the chunking to another argmax.
    let path = long_prompt_matches(&m, 8_400, &[engine::CacheTypes::default()], &[windows(&[0..4]), windows(&[0..1, 1..2, 2..4]), windows(&[0..3, 3..4])], 256);
    std::fs::remove_dir_all(path.parent().unwrap()).ok();
}

/// `m`, given a prompt of `n` tokens of real text, computes llama.cpp's last logits (the
/// same argmax, relative RMS below 1e-3) cut into each of `stages`, with each cache type of
/// `kvs`, hearth prefilling in chunks of `chunk`. The model's path (in a folder of its own).
fn long_prompt_matches(m: &RandomModel, n: usize, kvs: &[engine::CacheTypes], stages: &[Vec<Vec<Range<usize>>>], chunk: usize) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("hearth-tiny-{}-{}-long-{}", m.arch, m.seed, std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = common::tiny::write(m, &dir);
    let tok = Tokenizer::load(&path).unwrap();
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/prima-cpp-excerpt.txt")).unwrap();
    let mut prompt = Vec::new();
    while prompt.len() < n {
        prompt.extend(tok.tokenize(&text, false));
    }
    prompt.truncate(n);
    for &kv in kvs {
        let want = Reference::load(&path, THREADS).unwrap().with_cache_types(kv).last_logits(&prompt, 512).unwrap();
        for stages in stages {
            let cfg = |w: &Vec<Range<usize>>| engine::StageConfig { n_ctx_seq: n.div_ceil(512) * 512, max_batch: chunk, kv, ..common::stage_config(w.clone(), 1) };
            let built = stages.iter().map(|w| engine::Stage::new(std::sync::Arc::new(engine::ModelFile::open(&path).unwrap()), cfg(w)).unwrap()).collect();
            let mut p = engine::LocalPipeline::new(built).unwrap();
            let got = p.prefill(1, &prompt, chunk).unwrap();
            let err = common::rel_rms(&got, &want);
            assert_eq!(engine::reference::argmax(&got), engine::reference::argmax(&want), "{}: {kv:?} {stages:?}", m.arch);
            assert!(err < 1e-3, "{}: {kv:?} {stages:?}: relative RMS error {err}", m.arch);
            eprintln!("{} after {n} tokens, {kv:?}, {stages:?}: relative RMS error {err:.3e}", m.arch);
        }
    }
    path
}

#[test]
fn tiny_glm4moe_with_a_dense_lead_layer_shared_expert_and_partial_rope_matches_llama_cpp() {
    tiny(common::tiny::model("glm4moe"));
}

#[test]
fn tiny_gemma3_with_sliding_window_shorter_than_the_prompt_matches_llama_cpp() {
    let mut m = common::tiny::model("gemma3");
    // A window of 8 with a 2-layer pattern: layer 0 slides, layer 1 attends fully,
    // layer 2 slides; the 40-token prompt and 64 generated tokens cross it many times.
    m.n_swa = 8;
    m.head_dim = Some(32);
    m.extra = vec![("attention.sliding_window_pattern".into(), Value::U32(2)), ("rope.freq_base_swa".into(), Value::F32(10_000.0)), ("final_logit_softcapping".into(), Value::F32(30.0))];
    tiny(m);
}

#[test]
fn tiny_gpt_oss_with_sinks_sliding_window_and_mxfp4_experts_matches_llama_cpp() {
    let mut m = common::tiny::model("gpt-oss");
    m.n_swa = 8;
    tiny(m);
}

/// The ring's shape in one process: the head embeds (window 0..0) and owns the output
/// layer (30..30); "workers" run every layer and hand back hidden states only. Greedy
/// tokens equal llama.cpp's.
#[test]
fn head_owned_embedding_and_output_with_worker_windows_match_llama_cpp() {
    use engine::{ModelFile, Stage, StageConfig, StageInput, StageOutput};
    use std::sync::Arc;
    let path = common::default_model();
    let tok = Tokenizer::load(&path).unwrap();
    let prompt = chat_prompt(&tok, PROMPTS[2]);
    let expected = Reference::load(&path, THREADS).unwrap().greedy(&prompt, 48).unwrap();
    let file = Arc::new(ModelFile::open(&path).unwrap());
    let cfg = |windows: Vec<Range<usize>>, owns_output: bool| StageConfig { owns_output, ..common::stage_config(windows, 1) };
    let mut head = Stage::new(file.clone(), cfg(vec![0..0, 30..30], true)).unwrap();
    let mut w1 = Stage::new(file.clone(), cfg(vec![0..11], false)).unwrap();
    let mut w2 = Stage::new(file, cfg(vec![11..30], false)).unwrap();
    let hidden = |o: StageOutput| match o {
        StageOutput::Hidden(h) => h,
        StageOutput::Logits(_) => panic!("a worker returned logits"),
    };
    let mut step = |batch: &[BatchToken], ids: &[i32]| {
        let h = hidden(head.forward(0, batch, StageInput::Tokens(ids)).unwrap());
        let h = hidden(w1.forward(0, batch, StageInput::Hidden(&h)).unwrap());
        let h = hidden(w2.forward(0, batch, StageInput::Hidden(&h)).unwrap());
        match head.forward(1, batch, StageInput::Hidden(&h)).unwrap() {
            StageOutput::Logits(l) => argmax(l.row(l.rows.len() - 1)),
            StageOutput::Hidden(_) => panic!("the head's output window returned hidden states"),
        }
    };
    let batch: Vec<BatchToken> = (0..prompt.len()).map(|i| BatchToken { seq: 0, pos: i as u32, logits: i + 1 == prompt.len() }).collect();
    let mut got = vec![step(&batch, &prompt)];
    while got.len() < 48 {
        let pos = (prompt.len() + got.len() - 1) as u32;
        let next = step(&[BatchToken { seq: 0, pos, logits: true }], &[*got.last().unwrap()]);
        got.push(next);
    }
    assert_eq!(got, expected);
}

/// Sliding-window layers on a prompt long enough that they attend from a later cell than
/// the full layers (the window's start passes the 256-cell padding): logits at every
/// position and greedy tokens equal llama.cpp's, for both sliding-window archs.
#[test]
fn sliding_windows_far_into_a_long_prompt_match_llama_cpp() {
    use engine::{LocalPipeline, ModelFile, Stage};
    use std::sync::Arc;
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/scheduler.md")).unwrap();
    for arch in ["gemma3", "gpt-oss"] {
        let mut m = common::tiny::model(arch);
        m.n_swa = 48;
        let dir = std::env::temp_dir().join(format!("hearth-tiny-long-{}-{arch}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = common::tiny::write(&m, &dir);
        let tok = Tokenizer::load(&path).unwrap();
        let mut prompt = tok.tokenize(&text, false);
        prompt.truncate(700);
        assert_eq!(prompt.len(), 700);
        let reference = Reference::load(&path, THREADS).unwrap();
        let expected_logits = reference.prompt_logits(&prompt).unwrap();
        let expected = reference.greedy(&prompt, 24).unwrap();
        // The prompt as one batch, as the reference feeds it.
        let file = Arc::new(ModelFile::open(&path).unwrap());
        let cfg = engine::StageConfig { max_batch: 1024, ..common::stage_config(vec![0..3], 1) };
        let mut p = LocalPipeline::new(vec![Stage::new(file, cfg).unwrap()]).unwrap();
        let batch: Vec<BatchToken> = (0..prompt.len()).map(|i| BatchToken { seq: 3, pos: i as u32, logits: true }).collect();
        let logits = p.forward(&batch, &prompt).unwrap();
        let mut worst = 0f64;
        for (i, r) in expected_logits.iter().enumerate() {
            assert_eq!(argmax(logits.row(i)), argmax(r), "{arch}: argmax differs at position {i}");
            worst = worst.max(common::rel_rms(logits.row(i), r));
        }
        eprintln!("{arch}, 700 tokens, window 48: worst relative RMS error {worst:.3e}");
        assert!(worst < 1e-2, "{arch}: relative RMS error {worst}");
        assert_eq!(p.greedy(3, &prompt, 24, 1024).unwrap(), expected, "{arch}: greedy tokens differ from llama.cpp's");
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// A long prompt fed in chunks rounds as llama.cpp does with micro-batches of that size
/// (`n_ubatch`, llama-server's `-ub`): the chunk a ring pipelines a prompt in is such a
/// micro-batch. Which ggml path a kernel takes depends on the rows it gets (repacked
/// GEMM against GEMV, a MoE expert's share of the batch), so llama.cpp's own answer may
/// change with the micro-batch size; hearth's must change with it in the same way.
#[test]
fn a_prompt_in_chunks_matches_llama_cpp_in_micro_batches_of_that_size() {
    use engine::{LocalPipeline, ModelFile, Stage};
    use std::sync::Arc;
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/scheduler.md")).unwrap();
    let text: String = text.chars().take(5000).collect();
    for arch in ["gpt-oss", "qwen3moe"] {
        // The shape of the ring test's models (tests/ring.rs), whose answers differ by chunk.
        let mut m = RandomModel::new(arch, 6, 64, 128, 4, 2);
        m.n_ff_exp = 64;
        m.n_swa = 8;
        m.seed = 7;
        m.context_length = 2048;
        let dir = std::env::temp_dir().join(format!("hearth-chunks-{}-{arch}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = common::tiny::write(&m, &dir);
        let mut prompt = Tokenizer::load(&path).unwrap().tokenize(&text, true);
        prompt.truncate(1100);
        assert_eq!(prompt.len(), 1100);
        let reference = Reference::load(&path, THREADS).unwrap();
        let file = Arc::new(ModelFile::open(&path).unwrap());
        let cfg = engine::StageConfig { max_batch: 512, n_ctx_seq: 2048, ..common::stage_config(vec![0..6], 1) };
        let mut p = LocalPipeline::new(vec![Stage::new(file, cfg.clone()).unwrap()]).unwrap();
        let mut answers = Vec::new();
        for chunk in [37, 64, 512] {
            let expected = reference.greedy_in_ubatches(&prompt, 24, chunk).unwrap();
            assert_eq!(p.greedy(0, &prompt, 24, chunk).unwrap(), expected, "{arch}: chunks of {chunk} differ from llama.cpp's micro-batches of {chunk}");
            answers.push((chunk, expected));
        }
        let distinct = answers.iter().map(|a| &a.1).collect::<std::collections::BTreeSet<_>>().len();
        eprintln!("{arch}: {} prompt tokens, llama.cpp gives {distinct} different answers for micro-batches of 37, 64 and 512", prompt.len());
        // Batch-invariant kernels round every row alike whatever the batch: one answer.
        let cfg = engine::StageConfig { batch_invariant: true, ..cfg };
        let mut p = LocalPipeline::new(vec![Stage::new(Arc::new(ModelFile::open(&path).unwrap()), cfg).unwrap()]).unwrap();
        let whole = p.greedy(0, &prompt, 24, 512).unwrap();
        for chunk in [37, 64] {
            assert_eq!(p.greedy(0, &prompt, 24, chunk).unwrap(), whole, "{arch}: batch-invariant kernels, chunks of {chunk} against 512");
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// Qwen3.5 (`qwen35`): gated-delta-net linear attention in layers 0 and 2 (a causal
/// convolution continuing each sequence's last inputs, then a recurrent state per value
/// head, kept per sequence in place of a K/V cache), gated full attention with
/// multi-section RoPE in layer 1; llama.cpp's logits at every position and its greedy
/// tokens whole, in three windows (each recurrent layer alone in one) and in disjoint
/// windows on two stages.
#[test]
fn tiny_qwen35_with_linear_attention_and_a_recurrent_state_matches_llama_cpp() {
    tiny(common::tiny::model("qwen35"));
}

/// Qwen3.5's MoE form (35B-A3B, 122B-A10B): the experts beside a shared expert scaled by
/// the sigmoid of its own router; weights in Q8_0, as real files mostly are.
#[test]
fn tiny_qwen35moe_with_a_gated_shared_expert_matches_llama_cpp() {
    let mut m = common::tiny::model("qwen35moe");
    m.ty = engine::gguf::GgmlType::Q8_0;
    tiny(m);
}

/// Sequences of 20, ~90 and ~300 prompt tokens decoding together: each keeps its own
/// recurrent state in its own slot, the decode steps share one gated-delta-net op per layer
/// over consecutive slots, and every sequence's greedy tokens equal llama.cpp's streams.
#[test]
fn tiny_qwen35_sequences_decoding_together_match_llama_cpps_streams() {
    tiny_together(common::tiny::model("qwen35moe"));
}

/// Qwen3.5 with a prompt of real text near its context limit (3,900 of 4,096 tokens), fed
/// in chunks of 512 that each continue the recurrent state: llama.cpp's last logits whole
/// and in three windows, with an F16 and a q8_0 cache for the attention layers.
#[test]
fn tiny_qwen35_near_its_context_limit_matches_llama_cpp() {
    let mut m = common::tiny::model("qwen35");
    m.context_length = 4096;
    let q = engine::CacheTypes { k: engine::CacheType::Q8_0, v: engine::CacheType::Q8_0 };
    let path = long_prompt_matches(&m, 3_900, &[engine::CacheTypes::default(), q], &[windows(&[0..3]), windows(&[0..1, 1..2, 2..3])], 512);
    std::fs::remove_dir_all(path.parent().unwrap()).ok();
}

/// A recurrent state cannot be cut back like a K/V cache: truncating a Qwen3.5 sequence goes
/// back to the last checkpoint at or before the length asked (or to nothing), and what is
/// computed from there equals computing the same tokens from scratch, bit for bit — the
/// prompt cache's reuse of a shared prefix. A sequence starting again in a slot another used
/// starts from a zero state.
#[test]
fn qwen35_truncation_goes_back_to_a_checkpoint_and_continues_exactly() {
    let dir = std::env::temp_dir().join(format!("hearth-qwen35-checkpoint-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = common::tiny::write(&common::tiny::model("qwen35"), &dir);
    let tok = Tokenizer::load(&path).unwrap();
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/prima-cpp-excerpt.txt")).unwrap();
    let all = tok.tokenize(&text, false);
    let (a, b) = (&all[..300], &all[300..600]);
    // Two stages, as a ring's members would hold them.
    let mut p = pipeline(&path, &windows(&[0..2, 2..3]), 2);
    assert!(p.keeps_state());
    // The same tokens from scratch, fed in the same pieces (the chunking alone may move
    // the last bits of a prompt's logits).
    let fresh = |pieces: &[&[i32]]| {
        let mut q = pipeline(&path, &windows(&[0..3]), 1);
        pieces.iter().map(|piece| q.prefill(9, piece, 128).unwrap()).last().unwrap()
    };
    // A 300-token prompt, checkpointed at 200 tokens; then other tokens on top.
    p.prefill(1, &a[..200], 128).unwrap();
    p.checkpoint_sequence(1);
    p.prefill(1, &a[200..], 128).unwrap();
    p.prefill(1, &b[..50], 128).unwrap();
    assert_eq!(p.sequence_len(1), 350);
    // Back to 250: the state goes back to 200, the length kept.
    assert_eq!(p.truncate_sequence(1, 250), 200);
    assert_eq!(p.sequence_len(1), 200);
    let got = p.prefill(1, &b[..100], 128).unwrap();
    assert_eq!(got, fresh(&[&a[..200], &b[..100]]), "continuing from the checkpoint differs from computing from scratch");
    // Past the checkpoint nothing to go back to: a truncation then starts over.
    assert_eq!(p.truncate_sequence(1, 150), 0);
    assert_eq!(p.prefill(1, &b[..80], 128).unwrap(), fresh(&[&b[..80]]), "a sequence started over must start from a zero state");
    // Sequence 2 in the slot sequence 1 used, after it is cleared: a zero state too.
    p.clear_sequence(1);
    assert_eq!(p.prefill(2, &a[..64], 64).unwrap(), fresh(&[&a[..64]]));
    // Without recurrent layers a truncation keeps what it is asked to.
    let mut plain = pipeline(&common::default_model(), &windows(&[0..30]), 1);
    plain.prefill(3, &a[..100], 100).unwrap();
    assert_eq!(plain.truncate_sequence(3, 60), 60);
    assert!(!plain.keeps_state());
    std::fs::remove_dir_all(&dir).ok();
}

/// Speculative decoding on Qwen3.5: a batch with draft tokens leaves a snapshot of the
/// recurrent state where its drafts begin, a rejection takes the state back there (the
/// drafts it accepted are computed again in the next batch, before its next token), and
/// every logit on the way equals decoding the accepted tokens one at a time — bit for bit,
/// with batch-invariant kernels, on two stages as a ring's members hold them.
#[test]
fn qwen35_rejected_drafts_go_back_to_their_snapshot_and_decoding_continues_exactly() {
    let dir = std::env::temp_dir().join(format!("hearth-qwen35-drafts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = common::tiny::write(&common::tiny::model("qwen35"), &dir);
    let tok = Tokenizer::load(&path).unwrap();
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/prima-cpp-excerpt.txt")).unwrap();
    let all = tok.tokenize(&text, false);
    let file = std::sync::Arc::new(engine::ModelFile::open(&path).unwrap());
    let make = |ws: &[Range<usize>], draft_snapshots: bool| {
        let stages = ws.iter().map(|w| engine::Stage::new(file.clone(), engine::StageConfig { batch_invariant: true, draft_snapshots, ..common::stage_config(vec![w.clone()], 2) }).unwrap()).collect();
        engine::LocalPipeline::new(stages).unwrap()
    };
    let mut spec = make(&[0..2, 2..3], true);
    let mut plain = make(&[0..3], false);
    let prompt = &all[..120];
    spec.prefill(1, prompt, 64).unwrap();
    plain.prefill(1, prompt, 64).unwrap();
    // The truth: each token decoded alone.
    let mut decode = |t: i32| {
        let pos = plain.sequence_len(1) as u32;
        plain.forward(&[BatchToken { seq: 1, pos, logits: true }], &[t]).unwrap().row(0).to_vec()
    };
    // `before` (no logits), the decode token `t`, then `drafts`, all with logits.
    let verify = |p: &mut engine::LocalPipeline, before: &[i32], t: i32, drafts: &[i32]| {
        let base = p.sequence_len(1);
        let ids: Vec<i32> = before.iter().copied().chain(std::iter::once(t)).chain(drafts.iter().copied()).collect();
        let batch: Vec<BatchToken> = (0..ids.len()).map(|j| BatchToken { seq: 1, pos: (base + j) as u32, logits: j >= before.len() }).collect();
        let l = p.forward(&batch, &ids).unwrap();
        (0..=drafts.len()).map(|r| l.row(r).to_vec()).collect::<Vec<_>>()
    };
    let d = &all[200..208];
    // Step 1: t then 4 drafts; 2 accepted, the third rejected.
    let rows = verify(&mut spec, &[], d[0], &d[1..5]);
    for (j, &t) in d[..3].iter().enumerate() {
        assert_eq!(rows[j], decode(t), "row {j} of a batch with drafts differs from decoding its token alone");
    }
    let len = spec.sequence_len(1);
    assert_eq!(spec.truncate_sequence(1, len - 2), len - 4, "the state goes back to its snapshot, after the decode token");
    // Step 2: the two accepted drafts again, then the next token and 3 drafts; none
    // accepted: the snapshot is exactly where the drafts begin.
    let next = d[5];
    let rows = verify(&mut spec, &d[1..3], next, &d[6..8]);
    assert_eq!(rows[0], decode(next), "the token after replayed drafts differs from decoding it alone");
    let len = spec.sequence_len(1);
    assert_eq!(spec.truncate_sequence(1, len - 2), len - 2, "a draft rejected at once keeps the decode token");
    // Step 3: no drafts; then step 4: every draft accepted, the snapshot never used.
    for &t in &all[300..303] {
        let rows = verify(&mut spec, &[], t, &[]);
        assert_eq!(rows[0], decode(t), "decoding after a rejected draft differs");
    }
    let rows = verify(&mut spec, &[], all[303], &all[304..307]);
    for (j, &t) in all[303..307].iter().enumerate() {
        assert_eq!(rows[j], decode(t), "row {j} of a wholly accepted draft differs");
    }
    assert_eq!(spec.sequence_len(1), plain.sequence_len(1));
    // A cut below the snapshot has nothing to go back to but the start.
    assert_eq!(spec.truncate_sequence(1, 100), 0);
    std::fs::remove_dir_all(&dir).ok();
}

/// Eight sequences of one Qwen3.5 MoE (Q4_K_M) decoding together, their recurrent layers in
/// one op over eight slots: each sequence's 128 greedy tokens equal the tokens it gets
/// decoded alone, in hearth and in llama.cpp. Not yet understood: llama.cpp's own
/// eight-sequence batch leaves its single-sequence answer at token 40 on this file (not with
/// 2 to 7 sequences, not in Q8_0, not for a qwen3moe of the same size), which is why
/// `hearth bench` reports the batched tokens of the Qwen3.5-35B-A3B shape as differing on a
/// CPU; hearth's are the ones each sequence gets alone.
#[test]
fn qwen35_sequences_decoding_together_give_what_each_gets_alone() {
    let dir = std::env::temp_dir().join(format!("hearth-qwen35-together-alone-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut m = RandomModel::new("qwen35moe", 4, 512, 512, 4, 2);
    (m.n_expert, m.n_expert_used, m.n_ff_exp, m.full_every) = (16, 4, 512, 4);
    m.ty = engine::gguf::GgmlType::Q4_K;
    let path = common::tiny::write(&m, &dir);
    let tok = Tokenizer::load(&path).unwrap();
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/prima-cpp-excerpt.txt")).unwrap();
    let prompt = tok.tokenize(&text, false)[..64].to_vec();
    let prompts: Vec<Vec<i32>> = (0..8).map(|_| prompt.clone()).collect();
    // ggml's plain kernels (no repacked weights): a repacked K-quant's kernel takes rows
    // in blocks, so there a batch of eight rounds apart from one row anyway.
    let alone = Reference::load_with(&path, THREADS, false).unwrap().greedy(&prompt, 128).unwrap();
    let cfg = engine::StageConfig { max_batch: 512, repack: false, ..common::stage_config(vec![0..4], 8) };
    let mut p = engine::LocalPipeline::new(vec![engine::Stage::new(std::sync::Arc::new(engine::ModelFile::open(&path).unwrap()), cfg).unwrap()]).unwrap();
    assert_eq!(p.greedy(0, &prompt, 128, 512).unwrap(), alone, "hearth alone differs from llama.cpp alone");
    let (together, _) = p.decode_together(&prompts, 128, 512).unwrap();
    for (s, t) in together.iter().enumerate() {
        assert_eq!(t, &alone, "sequence {s} of 8 decoding together differs from the sequence alone");
    }
    std::fs::remove_dir_all(&dir).ok();
}
