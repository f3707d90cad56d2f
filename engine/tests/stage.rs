//! The stage's KV cache operations and its errors: rollback by truncation, clearing,
//! full sequences and caches, and batches or windows that make no sense. A failed call
//! must leave the cache as it was.

mod common;

use std::sync::Arc;

use common::{chat_prompt, feed, feed_in, greedy_after, pipeline, prefix_prompts, stage_config};
use engine::reference::argmax;
use engine::tokenizer::Tokenizer;
use engine::{BatchToken, Error, ModelFile, Stage, StageConfig, StageInput, StageOutput};

fn tok(seq: u64, pos: u32) -> BatchToken {
    BatchToken { seq, pos, logits: true }
}

#[test]
fn truncating_a_sequence_rolls_back_exactly() {
    let path = common::default_model();
    let tk = Tokenizer::load(&path).unwrap();
    let prompt = chat_prompt(&tk, "Tell me about the moon.");
    let mut p = pipeline(&path, &[vec![0..10], vec![10..30]], 1);
    let expected = p.greedy(0, &prompt, 24, 512).unwrap();

    // Generate 8 tokens, then pretend 5 wrong draft tokens were verified and rejected:
    // feed them, roll back, and continue. The result must not change.
    p.clear_sequence(0);
    let mut logits = p.prefill(1, &prompt, 512).unwrap();
    let mut got = Vec::new();
    for _ in 0..8 {
        let next = argmax(&logits);
        got.push(next);
        logits = p.forward(&[tok(1, (prompt.len() + got.len() - 1) as u32)], &[next]).unwrap().row(0).to_vec();
    }
    let len = p.sequence_len(1);
    assert_eq!(len, prompt.len() + 8);
    let junk = [11, 22, 33, 44, 55];
    let batch: Vec<BatchToken> = (0..5).map(|i| tok(1, (len + i) as u32)).collect();
    p.forward(&batch, &junk).unwrap();
    assert_eq!(p.sequence_len(1), len + 5);
    p.truncate_sequence(1, len);
    assert_eq!(p.sequence_len(1), len);
    while got.len() < 24 {
        let next = argmax(&logits);
        got.push(next);
        if got.len() < 24 {
            logits = p.forward(&[tok(1, (prompt.len() + got.len() - 1) as u32)], &[next]).unwrap().row(0).to_vec();
        }
    }
    assert_eq!(got, expected);
}

#[test]
fn full_sequences_and_full_caches_are_clear_errors() {
    let path = common::default_model();
    let file = Arc::new(ModelFile::open(&path).unwrap());
    let cfg = StageConfig { n_ctx_seq: 8, n_seq: 2, ..stage_config(vec![0..30], 2) };
    let mut s = Stage::new(file, cfg).unwrap();
    let ids = [1, 2, 3, 4, 5, 6, 7, 8, 9];
    let batch: Vec<BatchToken> = (0..9).map(|i| tok(5, i)).collect();
    match s.forward(0, &batch, StageInput::Tokens(&ids)) {
        Err(Error::SequenceFull { seq: 5, pos: 8, capacity: 8 }) => {}
        other => panic!("expected SequenceFull, got {other:?}"),
    }
    assert_eq!(s.sequence_len(0, 5), 0, "a failed batch must not change the cache");
    s.forward(0, &batch[..8], StageInput::Tokens(&ids[..8])).unwrap();
    assert!(matches!(s.forward(0, &[tok(5, 8)], StageInput::Tokens(&[1])), Err(Error::SequenceFull { .. })));

    s.forward(0, &[tok(6, 0)], StageInput::Tokens(&[1])).unwrap();
    match s.forward(0, &[tok(7, 0)], StageInput::Tokens(&[1])) {
        Err(e @ Error::CacheFull { slots: 2 }) => assert!(e.to_string().contains("2 sequence slots")),
        other => panic!("expected CacheFull, got {other:?}"),
    }
    // Clearing frees the slot for a new sequence.
    s.clear_sequence(6);
    s.forward(0, &[tok(7, 0)], StageInput::Tokens(&[1])).unwrap();
    assert_eq!(s.sequence_len(0, 7), 1);
}

#[test]
fn nonsense_batches_are_rejected_without_changing_the_cache() {
    let path = common::default_model();
    let file = Arc::new(ModelFile::open(&path).unwrap());
    let mut first = Stage::new(file.clone(), stage_config(vec![0..10], 2)).unwrap();
    let mut later = Stage::new(file, stage_config(vec![10..30], 2)).unwrap();
    first.forward(0, &[tok(1, 0), tok(1, 1)], StageInput::Tokens(&[1, 2])).unwrap();

    let cases: Vec<(Vec<BatchToken>, Vec<i32>, &str)> = vec![
        (vec![tok(1, 3)], vec![5], "does not follow its cached length 2"),
        (vec![tok(1, 2), tok(1, 2)], vec![5, 6], "does not follow"),
        (vec![tok(2, 1)], vec![5], "does not follow its cached length 0"),
        (vec![tok(1, 2)], vec![49_152], "outside the vocabulary"),
        (vec![tok(1, 2)], vec![-1], "outside the vocabulary"),
        (vec![], vec![], "a batch holds 1 to"),
        (vec![tok(1, 2), tok(1, 3)], vec![5], "takes 2 token ids"),
    ];
    for (batch, ids, want) in cases {
        let err = first.forward(0, &batch, StageInput::Tokens(&ids)).unwrap_err();
        assert!(err.to_string().contains(want), "{err} should mention {want:?}");
    }
    assert_eq!(first.sequence_len(0, 1), 2);
    let too_big: Vec<BatchToken> = (0..257).map(|i| tok(9, i)).collect();
    assert!(first.forward(0, &too_big, StageInput::Tokens(&vec![1; 257])).is_err());

    // A later window takes hidden states, not tokens, of the right size.
    let err = later.forward(0, &[tok(1, 0)], StageInput::Tokens(&[1])).unwrap_err();
    assert!(err.to_string().contains("hidden-state values"), "{err}");
    let err = later.forward(0, &[tok(1, 0)], StageInput::Hidden(&[0.0; 10])).unwrap_err();
    assert!(err.to_string().contains("1x576"), "{err}");
    assert!(matches!(later.forward(0, &[tok(1, 0)], StageInput::Hidden(&[0.0; 576])), Ok(StageOutput::Logits(_))));
    assert!(later.forward(1, &[tok(1, 1)], StageInput::Hidden(&[0.0; 576])).unwrap_err().to_string().contains("no window 1"));
}

#[test]
fn bad_window_layouts_are_rejected() {
    let path = common::default_model();
    let file = Arc::new(ModelFile::open(&path).unwrap());
    for (windows, want) in [
        (vec![0..10, 5..12], "overlaps"),
        (vec![20..31], "inside the model's 30 layers"),
        (vec![4..4], "non-empty"),
        (vec![], "at least one window"),
    ] {
        let err = Stage::new(file.clone(), stage_config(windows, 1)).err().expect("must fail");
        assert!(err.to_string().contains(want), "{err} should mention {want:?}");
    }
    let a = Stage::new(file.clone(), stage_config(vec![0..10], 1)).unwrap();
    let b = Stage::new(file, stage_config(vec![12..30], 1)).unwrap();
    let err = engine::LocalPipeline::new(vec![a, b]).err().expect("gap");
    assert!(err.to_string().contains("uncovered"), "{err}");
}

#[test]
fn unsupported_architectures_and_missing_tensors_are_named() {
    use engine::gguf::{GgufFile, GgufWriter, Value};
    let real = GgufFile::open(common::default_model()).unwrap();
    let dir = std::env::temp_dir().join(format!("hearth-arch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    let mut w = GgufWriter::from_meta(real.meta());
    w.set("general.architecture", Value::from("mamba")).unwrap();
    let p = dir.join("mamba.gguf");
    w.write_to(&p).unwrap();
    let err = ModelFile::open(&p).err().expect("mamba is not supported");
    assert!(matches!(&err, Error::UnsupportedArchitecture(a) if a == "mamba"), "{err}");

    // A MoE arch whose metadata lacks the expert counts is refused by name.
    let mut w = GgufWriter::from_meta(real.meta());
    for (k, v) in real.meta().metadata() {
        if let Some(rest) = k.strip_prefix("llama.") {
            w.set(format!("qwen3moe.{rest}"), v.clone()).unwrap();
        }
    }
    w.set("general.architecture", Value::from("qwen3moe")).unwrap();
    let p = dir.join("moe.gguf");
    w.write_to(&p).unwrap();
    let err = ModelFile::open(&p).err().expect("no expert counts");
    assert!(err.to_string().contains("qwen3moe.expert_count"), "{err}");

    // Right architecture, but the tensors are gone.
    let w = GgufWriter::from_meta(real.meta());
    let p = dir.join("empty.gguf");
    w.write_to(&p).unwrap();
    let err = ModelFile::open(&p).err().expect("no tensors");
    assert!(err.to_string().contains("token_embd.weight"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn accelerator_layers_need_an_accelerator_build() {
    if cfg!(any(feature = "cuda", feature = "metal", feature = "vulkan")) {
        return;
    }
    let file = Arc::new(ModelFile::open(common::default_model()).unwrap());
    let cfg = StageConfig { accel_layers: 2, ..stage_config(vec![0..30], 1) };
    let err = Stage::new(file, cfg).err().expect("no GPU backend in the default build");
    assert!(err.to_string().contains("--features cuda"), "{err}");
}

#[test]
fn windows_can_be_released_measured_and_prefetched() {
    use engine::residency::Prefetch;
    // A private copy, so no other test's mapping keeps its pages in the page cache.
    let dir = std::env::temp_dir().join(format!("hearth-resident-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.gguf");
    std::fs::copy(common::default_model(), &path).unwrap();
    // Freshly written pages are dirty and the kernel will not drop them until written back.
    std::fs::File::open(&path).unwrap().sync_all().unwrap();
    let file = Arc::new(ModelFile::open(&path).unwrap());
    let ranges = file.layer_byte_ranges(10..20);
    let total: usize = ranges.iter().map(|r| r.len()).sum();
    // Ten of thirty layers of ~2.2 MB each, page-rounded.
    assert!((21_000_000..23_500_000).contains(&total), "{total}");
    file.release(&ranges);
    let after_release = file.resident_bytes(&ranges);
    Prefetch::start(file.clone(), ranges.clone()).wait();
    let after_prefetch = file.resident_bytes(&ranges);
    eprintln!("window 10..20: {total} bytes, resident after release {after_release}, after prefetch {after_prefetch}");
    assert!(after_release < total / 2, "release left {after_release} of {total} bytes resident");
    assert_eq!(after_prefetch, total, "prefetch left pages out");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn fingerprints_tell_models_apart() {
    use engine::gguf::{GgufFile, GgufWriter};
    let real = ModelFile::open(common::default_model()).unwrap();
    let fp = real.fingerprint();
    assert_eq!(fp.len(), 64);
    assert_eq!(fp, ModelFile::open(common::default_model()).unwrap().fingerprint(), "deterministic");
    // Same header, one tensor's first byte changed: a different model.
    let dir = std::env::temp_dir().join(format!("hearth-fp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = GgufFile::open(common::default_model()).unwrap();
    let mut w = GgufWriter::from_meta(src.meta());
    for (i, t) in src.tensors().iter().enumerate() {
        let mut data = src.tensor_bytes(t).to_vec();
        if i == 100 {
            data[0] ^= 1;
        }
        w.add_tensor(t.name.clone(), t.ty, &t.dims, data).unwrap();
    }
    let p = dir.join("changed.gguf");
    w.write_to(&p).unwrap();
    assert_ne!(ModelFile::open(&p).unwrap().fingerprint(), fp);
    std::fs::remove_dir_all(&dir).ok();
}

/// The ring head's layout: layers 0..10 and the output layer 30..30 on one stage, the rest
/// on another. A prompt longer than a batch is fed in chunks and only the last chunk wants
/// logits; the output-only window of an earlier chunk has nothing to compute. Building
/// its graph anyway left its input unallocated and aborted the process (every ring prompt
/// over 512 tokens killed the head).
#[test]
fn a_prompt_chunk_that_wants_no_logits_passes_an_output_only_window() {
    let path = common::default_model();
    let tk = Tokenizer::load(&path).unwrap();
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/prima-cpp-excerpt.txt")).unwrap();
    let prompt = &tk.tokenize(&text, false)[..600];
    let file = Arc::new(ModelFile::open(&path).unwrap());
    let mut head = Stage::new(file.clone(), stage_config(vec![0..10, 30..30], 1)).unwrap();
    let mut rest = Stage::new(file, StageConfig { owns_output: false, ..stage_config(vec![10..30], 1) }).unwrap();
    let chunk = 256;
    let mut last = None;
    for (ci, part) in prompt.chunks(chunk).enumerate() {
        let batch: Vec<BatchToken> = (0..part.len()).map(|i| BatchToken { seq: 0, pos: (ci * chunk + i) as u32, logits: ci * chunk + i + 1 == prompt.len() }).collect();
        let StageOutput::Hidden(h) = head.forward(0, &batch, StageInput::Tokens(part)).unwrap() else { panic!("layers 0..10 give hidden states") };
        let StageOutput::Hidden(h) = rest.forward(0, &batch, StageInput::Hidden(&h)).unwrap() else { panic!("layers 10..30 of a worker give hidden states") };
        match head.forward(1, &batch, StageInput::Hidden(&h)).unwrap() {
            StageOutput::Logits(l) if batch.iter().any(|t| t.logits) => last = Some(l.row(0).to_vec()),
            StageOutput::Logits(l) => assert!(l.rows.is_empty(), "chunk {ci} wanted no logits"),
            StageOutput::Hidden(_) => panic!("the output window gives logits"),
        }
    }
    let expected = pipeline(&path, &[vec![0..30]], 1).prefill(0, prompt, chunk).unwrap();
    let got = last.expect("the last chunk wants logits");
    assert_eq!(argmax(&got), argmax(&expected));
    assert!(common::rel_rms(&got, &expected) < 1e-5, "relative RMS error {}", common::rel_rms(&got, &expected));
}

/// Every way a cache's rows are laid out that moving them must respect: the default model
/// whole, in two stages, with a quantized cache (Q8_0 K, Q4_0 V); a tiny Gemma 3 (sliding
/// window 48), a tiny Gemma 4 E cut after its donors (the second stage keeps its own copy
/// of their cache) and a tiny DeepSeek 2 (latent attention: V inside the K rows). Tiny
/// models are written under `dir`.
fn cache_layouts(dir: &std::path::Path) -> Vec<(&'static str, std::path::PathBuf, Vec<Vec<std::ops::Range<usize>>>, engine::CacheTypes)> {
    std::fs::create_dir_all(dir).unwrap();
    let default = common::default_model();
    let mut gemma3 = common::tiny::model("gemma3");
    gemma3.n_swa = 48;
    let mut gemma4e = common::tiny::model("gemma4");
    (gemma4e.n_layer, gemma4e.full_every, gemma4e.per_layer_embd, gemma4e.shared_kv_layers) = (6, 3, 32, 3);
    (gemma4e.n_expert, gemma4e.n_expert_used, gemma4e.n_swa, gemma4e.seed) = (0, 0, 40, 45);
    let f16 = engine::CacheTypes::default();
    let quantized = engine::CacheTypes { k: engine::CacheType::Q8_0, v: engine::CacheType::Q4_0 };
    vec![
        ("default model, one window", default.clone(), vec![vec![0..30]], f16),
        ("default model, two stages", default.clone(), vec![vec![0..10, 10..20], vec![20..30]], f16),
        ("default model, quantized cache", default, vec![vec![0..30]], quantized),
        ("tiny gemma3", common::tiny::write(&gemma3, dir), vec![vec![0..3]], f16),
        ("tiny gemma4 E, cut after the donors", common::tiny::write(&gemma4e, dir), vec![vec![0..3], vec![3..6]], f16),
        ("tiny deepseek2", common::tiny::write(&common::tiny::model("deepseek2"), dir), vec![vec![0..3]], f16),
    ]
}

/// The server's prompt cache across slots: a prefix copied from another sequence, then the
/// rest of a prompt computed after it, gives the logits of the whole prompt computed cold,
/// to the bit, where the copy ends on a whole tile of rows at least a tile before the
/// prompt's end (what the batcher copies); and the same greedy continuation. On the
/// default model in one window, cut across two stages, and with a quantized cache (Q8_0 K,
/// Q4_0 V); on a tiny Gemma 3 (sliding-window layers, the prompt far past the window), a
/// tiny Gemma 4 E (layers attending with earlier layers' K/V; cut after the donors, the
/// second stage keeps its own copy of their cache) and a tiny DeepSeek 2 (latent
/// attention: V inside the K rows). The copy replaces whatever the target held; a copy from an unknown sequence
/// copies nothing and leaves the target as it was.
#[test]
fn a_prefix_copied_from_another_sequence_computes_what_the_cold_prompt_computes() {
    let (a, b, shared) = prefix_prompts();
    let n = shared.min(b.len() - 64) / 64 * 64;
    assert!(n >= 256 && b.len() - n >= 64 && b.len() < 1000, "shared {shared}, b {} tokens", b.len());
    let dir = std::env::temp_dir().join(format!("hearth-copy-prefix-{}", std::process::id()));
    let cases = cache_layouts(&dir);
    for (what, path, stages, kv) in cases {
        let mut p = common::pipeline_with(&path, &stages, 3, kv);
        let cold = feed(&mut p, 2, &b);
        let cold_tokens = greedy_after(&mut p, 2, b.len(), &cold);
        feed(&mut p, 0, &a);
        // The target held another text before: the copy replaces it.
        feed(&mut p, 1, &a[a.len() - 100..]);
        assert_eq!(p.copy_sequence(0, 1, n), n, "{what}");
        assert_eq!(p.sequence_len(1), n, "{what}");
        let got = feed(&mut p, 1, &b[n..]);
        assert!(got == cold, "{what}: logits after the copied prefix differ from the cold prompt's (rel. RMS {:.2e})", common::rel_rms(&got, &cold));
        assert_eq!(greedy_after(&mut p, 1, b.len(), &got), cold_tokens, "{what}");
        // Nothing to copy from: the target keeps what it holds.
        let held = p.sequence_len(1);
        assert_eq!(p.copy_sequence(9, 1, 64), 0, "{what}");
        assert_eq!(p.sequence_len(1), held, "{what}");
        // A copy asks at most what the source holds.
        assert_eq!(p.copy_sequence(0, 2, usize::MAX), a.len(), "{what}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn rows_read_from_one_pipeline_and_written_into_another_compute_what_the_cold_prompt_computes() {
    // What the prompt cache does across a restart: a prefix's rows read in blocks from one
    // pipeline (the server before), written into a fresh one (the server after), the rest
    // of another prompt computed on top: logits and greedy tokens bit for bit the cold
    // prompt's, whatever the cache's types and however its tensors are shared.
    let (a, b, shared) = prefix_prompts();
    const BLOCK: usize = 128;
    let n = shared.min(b.len() - 64) / BLOCK * BLOCK;
    assert!(n >= 2 * BLOCK && b.len() - n >= 64, "shared {shared}, b {} tokens", b.len());
    let dir = std::env::temp_dir().join(format!("hearth-rows-{}", std::process::id()));
    let cases = cache_layouts(&dir);
    let f16 = engine::CacheTypes::default();
    for (what, path, stages, kv) in cases {
        let mut before = common::pipeline_with(&path, &stages, 3, kv);
        let cold = feed(&mut before, 2, &b);
        let cold_tokens = greedy_after(&mut before, 2, b.len(), &cold);
        feed(&mut before, 0, &a);
        let blocks: Vec<Vec<u8>> = (0..n / BLOCK).map(|i| before.read_rows(0, i * BLOCK, BLOCK, false).unwrap()).collect();
        assert!(before.read_rows(0, a.len() - 10, 11, false).is_none(), "{what}: rows past the sequence");
        let layout = before.row_layout().unwrap();
        drop(before);

        let mut after = common::pipeline_with(&path, &stages, 3, kv);
        assert_eq!(after.row_layout().unwrap(), layout, "{what}");
        // The slot held another text before: the blocks replace it.
        feed(&mut after, 1, &a[a.len() - 100..]);
        assert!(!after.write_rows(1, 101, BLOCK, &blocks[0]), "{what}: a block after a gap");
        assert!(!after.write_rows(1, 0, BLOCK, &blocks[0][1..]), "{what}: not whole rows");
        assert!(!after.write_rows(1, 0, BLOCK - 1, &blocks[0]), "{what}: another length");
        assert_eq!(after.sequence_len(1), 100, "{what}: a refused block changes nothing");
        for (i, block) in blocks.iter().enumerate() {
            assert!(after.write_rows(1, i * BLOCK, BLOCK, block), "{what}: block {i}");
        }
        assert_eq!(after.sequence_len(1), n, "{what}");
        let got = feed(&mut after, 1, &b[n..]);
        assert!(got == cold, "{what}: logits after the restored prefix differ from the cold prompt's (rel. RMS {:.2e})", common::rel_rms(&got, &cold));
        assert_eq!(greedy_after(&mut after, 1, b.len(), &got), cold_tokens, "{what}");
        // Another cache type is another layout: its blocks are never mixed in.
        let f32 = engine::CacheTypes { k: engine::CacheType::F32, v: engine::CacheType::F32 };
        let other = common::pipeline_with(&path, &stages, 1, if kv == f16 { f32 } else { f16 });
        assert_ne!(other.row_layout().unwrap(), layout, "{what}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A model keeping a recurrent state beside attention (a tiny Qwen3.5: gated delta net in
/// layers 0 and 2): a block holds the attention layers' rows alone (read at any position)
/// or ends with every recurrent layer's state where it ends (read only where the sequence
/// ends: the state of an earlier position no longer exists). The prompt cache keeps the
/// state only every few blocks, so a restore is blocks of rows alone and a last one with
/// the state: written into a fresh pipeline (a restart) over another text, the rest of
/// another prompt computed after them in the same pieces gives logits and greedy tokens bit
/// for bit the cold prompt's. Without the last block's state it does not (the other text's
/// state stays). In one window and in two stages (one without a recurrent layer in its
/// second window).
#[test]
fn a_recurrent_models_blocks_of_rows_alone_and_a_last_with_the_state_compute_what_the_cold_prompt_computes() {
    let (a, b, shared) = prefix_prompts();
    const BLOCK: usize = 128;
    let n = shared.min(b.len() - 64) / BLOCK * BLOCK;
    assert!(n >= 2 * BLOCK && b.len() - n >= 64, "shared {shared}, b {} tokens", b.len());
    let dir = std::env::temp_dir().join(format!("hearth-state-rows-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = common::tiny::write(&common::tiny::model("qwen35"), &dir);
    for stages in [vec![vec![0..3]], vec![vec![0..1, 1..2], vec![2..3]]] {
        let mut before = common::pipeline(&path, &stages, 3);
        let cold = feed_in(&mut before, 2, &b, BLOCK);
        let cold_tokens = greedy_after(&mut before, 2, b.len(), &cold);
        // The state where the prefix's last block ends, read as the prompt passes there;
        // the rows of every block alone, read once the whole prompt has landed.
        feed_in(&mut before, 0, &a[..n], BLOCK);
        let last = before.read_rows(0, n - BLOCK, BLOCK, true).unwrap();
        feed_in(&mut before, 0, &a[n..], BLOCK);
        assert!(before.read_rows(0, n - BLOCK, BLOCK, true).is_none(), "{stages:?}: the state before the sequence's end is gone");
        let rows: Vec<Vec<u8>> = (0..n / BLOCK).map(|i| before.read_rows(0, i * BLOCK, BLOCK, false).unwrap()).collect();
        assert!(rows.iter().all(|r| r.len() == rows[0].len()) && last.len() > rows[0].len(), "{stages:?}: rows alone, then rows and the state");
        if stages.len() == 1 {
            // One window: its rows come first either way (with windows, each window's
            // state follows its rows).
            assert_eq!(&last[..rows[0].len()], &rows[n / BLOCK - 1][..], "{stages:?}: the same rows either way");
        }
        let layout = before.row_layout().unwrap();
        assert!(layout.contains("state["), "{layout}");
        drop(before);

        for with_state in [true, false] {
            let mut after = common::pipeline(&path, &stages, 3);
            assert_eq!(after.row_layout().unwrap(), layout);
            // Another text's state first: the last block's state must replace it.
            feed_in(&mut after, 1, &a[a.len() - 100..], BLOCK);
            assert!(!after.write_rows(1, 0, BLOCK, &last[1..]), "{stages:?}: not a whole block");
            assert!(!after.write_rows(1, 0, BLOCK, &rows[0][1..]), "{stages:?}: not whole rows");
            assert_eq!(after.sequence_len(1), 100, "{stages:?}: a refused block changes nothing");
            for (i, block) in rows[..n / BLOCK - 1].iter().enumerate() {
                assert!(after.write_rows(1, i * BLOCK, BLOCK, block), "{stages:?}: block {i}");
            }
            let end = if with_state { &last } else { &rows[n / BLOCK - 1] };
            assert!(after.write_rows(1, n - BLOCK, BLOCK, end), "{stages:?}: the last block");
            assert_eq!(after.sequence_len(1), n);
            let got = feed_in(&mut after, 1, &b[n..], BLOCK);
            if with_state {
                assert!(got == cold, "{stages:?}: logits after the restored prefix differ from the cold prompt's (rel. RMS {:.2e})", common::rel_rms(&got, &cold));
                assert_eq!(greedy_after(&mut after, 1, b.len(), &got), cold_tokens, "{stages:?}");
            } else {
                assert!(got != cold, "{stages:?}: rows alone brought the state back: the test shows nothing");
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}
