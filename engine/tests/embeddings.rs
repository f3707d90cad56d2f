//! The embedding model (`engine::embedder`) against llama.cpp on tiny random models of the
//! embedding architectures hearth serves: `bert` (all-MiniLM, bge; mean pooling),
//! `nomic-bert` (nomic-embed-text; mean) and `qwen3` with last-token pooling
//! (Qwen3-Embedding), and CLS pooling chosen by the operator. The reference is llama.cpp's
//! own per-token output (no pooling) of each input alone, pooled here by hand: so the
//! pooling hearth asks for, the packing of many inputs into one decode and the special
//! tokens it adds are all checked, on real text of 1 to ~500 tokens.

mod common;

use engine::embedder::{normalize, Embedder, EmbedderConfig, Pooling, MAX_SEQS_PER_DECODE};
use engine::reference::Reference;

const CTX: usize = 512;

fn text() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/prima-cpp-excerpt.txt")).unwrap()
}

/// Inputs of many lengths cut from real text: from one word to nearly the whole context,
/// each grown word by word to its token count under `tokenize`.
fn inputs(tokenize: impl Fn(&str) -> usize) -> Vec<String> {
    let text = text();
    let words: Vec<&str> = text.split_whitespace().collect();
    let mut out = vec!["the".to_string()];
    let mut at = 0;
    for target in [3, 17, 60, 2, 120, 9, 33, 240, 5, 450] {
        let mut n = 1;
        while tokenize(&words[at..at + n + 1].join(" ")) <= target {
            n += 1;
        }
        out.push(words[at..at + n].join(" "));
        at += n;
    }
    out
}

/// How far a vector may be from llama.cpp's (relative RMS). ggml picks its matrix kernels
/// by the number of rows in a decode, so one input computed among many others differs
/// from it alone by rounding: 3.6e-4 measured on the tiny BERT. A wrong pooling, a token
/// dropped or another input's token attended to moves it by more than 1e-1.
const TOLERANCE: f64 = 2e-3;

fn write(m: &engine::random_model::RandomModel, dir: &std::path::Path) -> std::path::PathBuf {
    common::tiny::write(m, dir)
}

fn model(arch: &str) -> engine::random_model::RandomModel {
    engine::random_model::RandomModel::tiny_embedder(arch)
}

fn pool(tokens: &[Vec<f32>], pooling: Pooling) -> Vec<f32> {
    match pooling {
        Pooling::Cls => tokens[0].clone(),
        Pooling::Last => tokens[tokens.len() - 1].clone(),
        Pooling::Mean => {
            let mut sum = vec![0f64; tokens[0].len()];
            for t in tokens {
                for (s, x) in sum.iter_mut().zip(t) {
                    *s += *x as f64;
                }
            }
            sum.iter().map(|s| (*s / tokens.len() as f64) as f32).collect()
        }
    }
}

/// Checks every input's embedding, all computed together, against llama.cpp's per-token
/// output of that input alone, pooled by hand.
fn check(path: &std::path::Path, pooling: Option<Pooling>, expect: Pooling) {
    let mut e = Embedder::load(path, &EmbedderConfig { threads: common::THREADS, ctx_size: Some(CTX), pooling }).unwrap();
    assert_eq!(e.pooling(), expect);
    let reference = Reference::load(path, common::THREADS).unwrap();
    let texts = inputs(|t| e.tokenize(t).len());
    let tokens: Vec<Vec<i32>> = texts.iter().map(|t| e.tokenize(t)).collect();
    assert!(tokens.iter().any(|t| t.len() > 300 && t.len() <= CTX) && tokens.iter().any(|t| t.len() <= 3), "{:?}", tokens.iter().map(Vec::len).collect::<Vec<_>>());
    let all: Vec<&[i32]> = tokens.iter().map(Vec::as_slice).collect();
    let together = e.embed(&all).unwrap();
    assert_eq!(together.len(), texts.len());
    for (i, t) in tokens.iter().enumerate() {
        let want = pool(&reference.token_embeddings(t).unwrap(), expect);
        let got = &together[i];
        assert_eq!(got.len(), e.dims());
        assert!(got.iter().all(|x| x.is_finite()));
        let err = common::rel_rms(got, &want);
        assert!(err < TOLERANCE, "{}: input {i} ({} tokens): relative RMS error {err} against llama.cpp", path.display(), t.len());
        // Alone it is the same vector as among the others.
        let alone = e.embed(&[t.as_slice()]).unwrap().remove(0);
        assert!(common::rel_rms(&alone, got) < TOLERANCE, "input {i} alone differs from input {i} among the others");
    }
    // Different texts give different vectors (a wiring mistake that ignores the input
    // would pass the comparisons above only if llama.cpp made it too).
    let (mut a, mut b) = (together[3].clone(), together[5].clone());
    normalize(&mut a);
    normalize(&mut b);
    let cos: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
    assert!(cos < 0.999, "two different texts embed alike (cosine {cos})");
}

#[test]
fn bert_mean_pooling_equals_llama_cpp() {
    let dir = tempdir();
    let path = write(&model("bert"), &dir);
    check(&path, None, Pooling::Mean);
    // bge pools on [CLS]: the operator's choice overrides the file's.
    check(&path, Some(Pooling::Cls), Pooling::Cls);
}

#[test]
fn nomic_bert_equals_llama_cpp() {
    let dir = tempdir();
    let path = write(&model("nomic-bert"), &dir);
    check(&path, None, Pooling::Mean);
}

#[test]
fn qwen3_last_token_pooling_equals_llama_cpp() {
    let dir = tempdir();
    let path = write(&model("qwen3"), &dir);
    check(&path, None, Pooling::Last);
}

#[test]
fn bert_tokenizer_adds_cls_and_sep() {
    let dir = tempdir();
    let path = write(&model("bert"), &dir);
    let e = Embedder::load(&path, &EmbedderConfig { threads: 1, ctx_size: Some(CTX), pooling: None }).unwrap();
    let t = e.tokenize("the model layers");
    assert_eq!(t.first(), Some(&101), "{t:?}");
    assert_eq!(t.last(), Some(&102), "{t:?}");
    assert!(t.len() == 5, "whole words of the vocabulary are one token each: {t:?}");
}

#[test]
fn more_inputs_than_one_decode_holds_and_bad_inputs() {
    let dir = tempdir();
    let path = write(&model("bert"), &dir);
    let mut e = Embedder::load(&path, &EmbedderConfig { threads: 1, ctx_size: Some(CTX), pooling: None }).unwrap();
    // Short inputs: the decode fills up on inputs (MAX_SEQS_PER_DECODE) before tokens.
    let texts: Vec<String> = (0..MAX_SEQS_PER_DECODE + 7).map(|i| format!("token {i} of the cluster")).collect();
    let tokens: Vec<Vec<i32>> = texts.iter().map(|t| e.tokenize(t)).collect();
    let all: Vec<&[i32]> = tokens.iter().map(Vec::as_slice).collect();
    let vectors = e.embed(&all).unwrap();
    assert_eq!(vectors.len(), texts.len());
    for (i, t) in tokens.iter().enumerate().step_by(13) {
        let alone = e.embed(&[t.as_slice()]).unwrap().remove(0);
        let err = common::rel_rms(&alone, &vectors[i]);
        assert!(err < TOLERANCE, "input {i} {t:?}: alone differs from among the others by {err}");
    }
    // Empty, too long, out of the vocabulary: errors, never handed to llama.cpp.
    assert!(e.embed(&[&[]]).is_err());
    assert!(e.embed(&[&vec![105; CTX + 1]]).is_err());
    assert!(e.embed(&[&[101, 1_000_000, 102]]).is_err());
    assert!(e.embed(&[&[101, -1, 102]]).is_err());
    // And the embedder still works after them.
    assert_eq!(e.embed(&[&tokens[0]]).unwrap().len(), 1);
}

#[test]
fn a_model_without_pooling_needs_the_operators_choice() {
    let dir = tempdir();
    let mut m = model("qwen3");
    m.extra.clear();
    let path = write(&m, &dir);
    let err = Embedder::load(&path, &EmbedderConfig { threads: 1, ctx_size: Some(CTX), pooling: None }).err().expect("no pooling in the file");
    assert!(err.to_string().contains("--embedding-pooling"), "{err}");
    assert!(Embedder::load(&path, &EmbedderConfig { threads: 1, ctx_size: Some(CTX), pooling: Some(Pooling::Mean) }).is_ok());
}

fn tempdir() -> std::path::PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!("hearth-embed-test-{}-{}", std::process::id(), N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
    std::fs::create_dir_all(&d).unwrap();
    d
}
