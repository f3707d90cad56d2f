//! `hearth make-model`: writes a random-weight GGUF of any supported architecture and
//! size (the engine's `random_model` writer), for experiments that need a model larger
//! than memory (the memory experiments in docs/benchmarks.md) or an architecture with no
//! small real model at hand.

use std::path::PathBuf;

use engine::gguf::GgmlType;
use engine::random_model::RandomModel;

use crate::cli::MakeModelArgs;

pub fn run(args: MakeModelArgs) -> Result<(), Box<dyn std::error::Error>> {
    let ty = match args.r#type.as_str() {
        "q8_0" => GgmlType::Q8_0,
        "q4_0" => GgmlType::Q4_0,
        "f16" => GgmlType::F16,
        other => return Err(format!("--type {other}: use q8_0, q4_0 or f16").into()),
    };
    let mut m = RandomModel::new(&args.arch, args.layers, args.embd, args.ff, args.heads, args.kv_heads);
    m.ty = ty;
    m.head_dim = args.head_dim;
    m.seed = args.seed;
    if m.n_expert > 0 {
        m.n_expert = args.experts;
        m.n_expert_used = args.experts_used;
        m.n_ff_exp = args.expert_ff.unwrap_or(args.ff / args.experts_used.max(1) as u64);
    }
    if m.n_swa > 0 {
        m.n_swa = args.window;
    }
    let tokenizer: PathBuf = args.tokenizer_from.resolve()?;
    let size = m.write(&tokenizer, &args.out)?;
    println!("{} ({} {} layers, e={}, ff={}, {ty}): {size} bytes", args.out.display(), args.arch, args.layers, args.embd, args.ff);
    Ok(())
}
