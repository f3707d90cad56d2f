//! Tiny random-weight models (the engine's own writer, `engine::random_model`) of the
//! architectures hearth runs but has no small real model of here.

use std::path::{Path, PathBuf};

use engine::random_model::RandomModel;

/// The tiny shape every arch test starts from: 3 layers (Llama 4: 4), e = 64, 4 heads of 16, 2 KV
/// heads; MoE archs get 8 experts of 64 with 2 used per token.
pub fn model(arch: &str) -> RandomModel {
    // Llama 4 needs a fourth layer: every fourth is its NoPE, full-attention layer.
    let mut m = RandomModel::new(arch, if arch == "llama4" { 4 } else { 3 }, 64, 160, 4, 2);
    if m.n_expert > 0 {
        m.n_ff_exp = 64;
    }
    m.context_length = 2048;
    m.seed = 42;
    m
}

/// Writes `m` to `dir` with the default model's tokenizer and returns its path.
pub fn write(m: &RandomModel, dir: &Path) -> PathBuf {
    let path = dir.join(format!("tiny-{}-{}.gguf", m.arch, m.seed));
    m.write(&super::default_model(), &path).unwrap();
    path
}
