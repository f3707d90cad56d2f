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
        "q4_k_m" => GgmlType::Q4_K,
        other => return Err(format!("--type {other}: use q8_0, q4_0, f16 or q4_k_m").into()),
    };
    let mut m = RandomModel::new(&args.arch, args.layers, args.embd, args.ff, args.heads, args.kv_heads);
    m.ty = ty;
    m.head_dim = args.head_dim;
    m.seed = args.seed;
    m.context_length = args.context_length;
    if m.n_expert > 0 {
        m.n_expert = args.experts;
        m.n_expert_used = args.experts_used;
        m.n_ff_exp = args.expert_ff.unwrap_or(args.ff / args.experts_used.max(1) as u64);
    }
    if m.n_swa > 0 {
        m.n_swa = args.window;
    }
    m.full_every = args.full_every;
    m.full_kv_heads = args.full_kv_heads;
    m.per_layer_embd = args.per_layer_embd;
    m.shared_kv_layers = args.shared_kv_layers;
    let tokenizer: PathBuf = args.tokenizer_from.resolve()?;
    let what = format!("{} {} layers, e={}, ff={}, {}", args.arch, args.layers, args.embd, args.ff, args.r#type);
    match &args.split_max_size {
        None => {
            let size = m.write(&tokenizer, &args.out)?;
            println!("{} ({what}): {size} bytes", args.out.display());
        }
        Some(s) => {
            let max = engine::gguf::split::parse_size(s).ok_or_else(|| format!("--split-max-size {s}: give a size such as 20G, 500M or a number of bytes"))?;
            for part in m.write_split(&tokenizer, &engine::gguf::split::prefix_of(&args.out), max)? {
                println!("{} ({what}): {} bytes", part.display(), std::fs::metadata(&part)?.len());
            }
        }
    }
    Ok(())
}
