//! The vocabulary fixture (`testdata/smollm2-vocab.gguf`) that the server's in-process
//! tests load instead of the default model, so `cargo test --lib` needs no network: it is
//! exactly what the project's writer makes of the default model today, and it tokenizes,
//! detokenizes and renders chats as the default model does.
//! `HEARTH_UPDATE_FIXTURES=1` writes it again.

mod common;

use std::path::PathBuf;

use engine::random_model::{write_vocabulary, RandomModel};
use engine::tokenizer::Tokenizer;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/smollm2-vocab.gguf")
}

#[test]
fn the_fixture_is_the_writers_copy_of_the_default_models_vocabulary() {
    let model = common::default_model();
    let out = std::env::temp_dir().join(format!("hearth-vocab-{}.gguf", std::process::id()));
    write_vocabulary(&model, &out).unwrap();
    let fresh = std::fs::read(&out).unwrap();
    let _ = std::fs::remove_file(&out);
    if std::env::var_os("HEARTH_UPDATE_FIXTURES").is_some() {
        // Renamed into place: the other tests here read the fixture meanwhile.
        let next = fixture().with_extension("gguf.new");
        std::fs::write(&next, &fresh).unwrap();
        std::fs::rename(&next, fixture()).unwrap();
    }
    let kept = std::fs::read(fixture()).expect("testdata/smollm2-vocab.gguf (HEARTH_UPDATE_FIXTURES=1 writes it)");
    assert!(kept == fresh, "testdata/smollm2-vocab.gguf differs from what the writer makes of {} now: run this test with HEARTH_UPDATE_FIXTURES=1", model.display());
    assert!(kept.len() < 4 << 20, "the fixture should stay small: {} bytes", kept.len());
}

#[test]
fn the_fixture_tokenizes_and_renders_as_the_default_model() {
    let (real, fixture) = (Tokenizer::load(common::default_model()).unwrap(), Tokenizer::load(fixture()).unwrap());
    assert_eq!(real.n_vocab(), fixture.n_vocab());
    assert_eq!(real.chat_template_source(), fixture.chat_template_source());
    let text = std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/prima-cpp-excerpt.txt")).unwrap();
    let text: String = text.chars().take(8_000).collect();
    let tokens = real.tokenize(&text, false);
    assert!(tokens.len() > 1_000);
    assert_eq!(tokens, fixture.tokenize(&text, false));
    let special = "<|im_start|>user\nHello, 世界 🙂<|im_end|>";
    assert_eq!(real.tokenize(special, true), fixture.tokenize(special, true));
    assert_eq!(fixture.detokenize(&tokens), real.detokenize(&tokens));
}

#[test]
fn a_random_model_takes_its_tokenizer_from_the_fixture() {
    let out = std::env::temp_dir().join(format!("hearth-vocab-model-{}.gguf", std::process::id()));
    RandomModel::new("llama", 2, 64, 128, 4, 2).write(&fixture(), &out).unwrap();
    let file = engine::ModelFile::open(&out).unwrap();
    let vocab = Tokenizer::load(fixture()).unwrap().n_vocab();
    assert_eq!(file.spec.n_vocab, vocab);
    let _ = std::fs::remove_file(&out);
}
