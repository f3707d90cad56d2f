//! `hearth make-model`: writes a random-weight llama-architecture GGUF of any size, for
//! experiments that need a model larger than memory (the memory experiment in
//! docs/benchmarks.md). The tokenizer is copied from a real GGUF (the default model), so
//! the file serves like any other; the weights are seeded noise scaled so activations
//! stay finite through many layers. Tensors are generated and written one at a time, so
//! a file of many GiB needs only the largest tensor in memory.

use std::path::PathBuf;

use engine::gguf::{GgmlType, GgufFile, GgufWriter, Value};

use crate::cli::MakeModelArgs;

/// xorshift64*: fast, seeded, good enough for noise weights.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in [-1, 1).
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// f32 -> IEEE half (round toward zero; subnormals flush to zero): enough for weights.
fn f16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    if exp <= 0 {
        return sign;
    }
    if exp >= 31 {
        return sign | 0x7c00;
    }
    sign | ((exp as u16) << 10) | ((b >> 13) & 0x3ff) as u16
}

/// Fills `buf` with a tensor of type `ty` whose values have about `std` spread (norm
/// weights: `center` ± 0.1).
fn fill(rng: &mut Rng, ty: GgmlType, buf: &mut [u8], std: f32, center: f32) {
    match ty {
        GgmlType::F32 => {
            for c in buf.chunks_exact_mut(4) {
                c.copy_from_slice(&(center + 0.1 * rng.unit()).to_le_bytes());
            }
        }
        GgmlType::F16 => {
            // Uniform in [-a, a) has std a/sqrt(3).
            let a = std * 3f32.sqrt();
            for c in buf.chunks_exact_mut(2) {
                c.copy_from_slice(&f16_bits(a * rng.unit()).to_le_bytes());
            }
        }
        GgmlType::Q8_0 => {
            // Blocks of 32: an f16 scale d and 32 int8; uniform int8 has std ~73.9.
            let d = f16_bits(std / 73.9).to_le_bytes();
            for block in buf.chunks_exact_mut(34) {
                block[..2].copy_from_slice(&d);
                for c in block[2..].chunks_mut(8) {
                    let r = rng.next().to_le_bytes();
                    c.copy_from_slice(&r[..c.len()]);
                }
            }
        }
        GgmlType::Q4_0 => {
            // Blocks of 32: an f16 scale d and 16 bytes of nibbles q, value d*(q-8); std ~4.6.
            let d = f16_bits(std / 4.6).to_le_bytes();
            for block in buf.chunks_exact_mut(18) {
                block[..2].copy_from_slice(&d);
                block[2..10].copy_from_slice(&rng.next().to_le_bytes());
                block[10..18].copy_from_slice(&rng.next().to_le_bytes());
            }
        }
        other => unreachable!("make-model does not write {other}"),
    }
}

pub fn run(args: MakeModelArgs) -> Result<(), Box<dyn std::error::Error>> {
    let ty = match args.r#type.as_str() {
        "q8_0" => GgmlType::Q8_0,
        "q4_0" => GgmlType::Q4_0,
        "f16" => GgmlType::F16,
        other => return Err(format!("--type {other}: use q8_0, q4_0 or f16").into()),
    };
    let (e, ff, n_head, n_head_kv) = (args.embd, args.ff, args.heads, args.kv_heads);
    if e % 32 != 0 || ff % 32 != 0 || n_head == 0 || e % n_head as u64 != 0 || n_head_kv == 0 || n_head % n_head_kv != 0 {
        return Err("need --embd and --ff multiples of 32, --heads dividing --embd, --kv-heads dividing --heads".into());
    }
    let tokenizer: PathBuf = args.tokenizer_from.resolve()?;
    let real = GgufFile::open(&tokenizer)?;
    let n_vocab = real.tensor("token_embd.weight").ok_or("the tokenizer model has no token_embd.weight")?.dims[1];

    let mut w = GgufWriter::new();
    for (k, v) in real.meta().metadata() {
        if k.starts_with("tokenizer.") {
            w.set(k.clone(), v.clone())?;
        }
    }
    let a = "llama";
    w.set("general.architecture", Value::from(a))?;
    w.set("general.name", Value::from(format!("random-llama-{}x{e}-{}", args.layers, ty)))?;
    w.set(format!("{a}.block_count"), Value::U32(args.layers))?;
    w.set(format!("{a}.context_length"), Value::U32(4096))?;
    w.set(format!("{a}.embedding_length"), Value::U32(e as u32))?;
    w.set(format!("{a}.feed_forward_length"), Value::U32(ff as u32))?;
    w.set(format!("{a}.attention.head_count"), Value::U32(n_head))?;
    w.set(format!("{a}.attention.head_count_kv"), Value::U32(n_head_kv))?;
    w.set(format!("{a}.attention.layer_norm_rms_epsilon"), Value::F32(1e-5))?;
    w.set(format!("{a}.rope.freq_base"), Value::F32(10_000.0))?;
    w.set(format!("{a}.rope.dimension_count"), Value::U32((e / n_head as u64) as u32))?;

    let kv = e / n_head as u64 * n_head_kv as u64;
    // Tied output: token_embd is also the LM head.
    w.add_tensor_later("token_embd.weight", ty, &[e, n_vocab])?;
    w.add_tensor_later("output_norm.weight", GgmlType::F32, &[e])?;
    for il in 0..args.layers {
        let t = |n: &str| format!("blk.{il}.{n}");
        w.add_tensor_later(t("attn_norm.weight"), GgmlType::F32, &[e])?;
        w.add_tensor_later(t("attn_q.weight"), ty, &[e, e])?;
        w.add_tensor_later(t("attn_k.weight"), ty, &[e, kv])?;
        w.add_tensor_later(t("attn_v.weight"), ty, &[e, kv])?;
        w.add_tensor_later(t("attn_output.weight"), ty, &[e, e])?;
        w.add_tensor_later(t("ffn_norm.weight"), GgmlType::F32, &[e])?;
        w.add_tensor_later(t("ffn_gate.weight"), ty, &[e, ff])?;
        w.add_tensor_later(t("ffn_up.weight"), ty, &[e, ff])?;
        w.add_tensor_later(t("ffn_down.weight"), ty, &[ff, e])?;
    }
    let mut rng = Rng(args.seed | 1);
    let mut written = 0u64;
    w.write_streaming(&args.out, |name, ty, dims, buf| {
        // Matrices: spread 1/sqrt(fan-in) keeps each layer's output near unit scale;
        // embeddings: unit rows.
        let std = if name == "token_embd.weight" { 1.0 } else { 0.7 / (dims[0] as f32).sqrt() };
        fill(&mut rng, ty, buf, std, 1.0);
        written += buf.len() as u64;
    })?;
    let size = std::fs::metadata(&args.out)?.len();
    println!("{} ({} layers, e={e}, ff={ff}, {ty}): {size} bytes, {written} of them weights", args.out.display(), args.layers);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_precision_bits() {
        assert_eq!(f16_bits(1.0), 0x3c00);
        assert_eq!(f16_bits(-2.0), 0xc000);
        assert_eq!(f16_bits(0.0), 0);
        assert_eq!(f16_bits(1e-9), 0);
        assert_eq!(f16_bits(1e9), 0x7c00);
    }

    #[test]
    fn noise_is_centred_and_bounded() {
        let mut r = Rng(42);
        let xs: Vec<f32> = (0..10_000).map(|_| r.unit()).collect();
        assert!(xs.iter().all(|x| (-1.0..1.0).contains(x)));
        let mean = xs.iter().sum::<f32>() / xs.len() as f32;
        assert!(mean.abs() < 0.05, "{mean}");
    }
}
