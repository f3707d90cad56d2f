//! Tiny random-weight models of the architectures hearth runs but has no small real
//! model of here. They carry the default model's tokenizer (so llama.cpp loads them as
//! it would a real file) and seeded random weights (so any wiring mistake — a missing
//! bias, a wrong RoPE mode, norms in the wrong place — changes the logits).

use std::path::{Path, PathBuf};

use engine::gguf::{GgmlType, GgufFile, GgufWriter, Value};
use half::f16;
use rand::{rngs::StdRng, Rng, SeedableRng};

pub struct TinySpec {
    pub arch: &'static str,
    pub n_layer: u32,
    pub n_embd: u64,
    pub n_ff: u64,
    pub n_head: u32,
    pub n_head_kv: u32,
    pub qkv_bias: bool,
    pub qk_norm: bool,
    pub tied_output: bool,
    /// Extra metadata (e.g. Mistral's attention temperature).
    pub extra: Vec<(&'static str, Value)>,
}

fn random(rng: &mut StdRng, n: usize, center: f32, spread: f32) -> Vec<f32> {
    (0..n).map(|_| center + rng.gen_range(-spread..spread)).collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| f16::from_f32(*x).to_le_bytes()).collect()
}

/// Writes the tiny model to `dir` and returns its path.
pub fn write(spec: &TinySpec, dir: &Path, seed: u64) -> PathBuf {
    let real = GgufFile::open(super::default_model()).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in real.meta().metadata() {
        if k.starts_with("tokenizer.") {
            w.set(k.clone(), v.clone()).unwrap();
        }
    }
    let n_vocab = real.tensor("token_embd.weight").unwrap().dims[1];
    let a = spec.arch;
    w.set("general.architecture", Value::from(a)).unwrap();
    w.set("general.name", Value::from(format!("tiny-{a}"))).unwrap();
    w.set(format!("{a}.block_count"), Value::U32(spec.n_layer)).unwrap();
    w.set(format!("{a}.context_length"), Value::U32(2048)).unwrap();
    w.set(format!("{a}.embedding_length"), Value::U32(spec.n_embd as u32)).unwrap();
    w.set(format!("{a}.feed_forward_length"), Value::U32(spec.n_ff as u32)).unwrap();
    w.set(format!("{a}.attention.head_count"), Value::U32(spec.n_head)).unwrap();
    w.set(format!("{a}.attention.head_count_kv"), Value::U32(spec.n_head_kv)).unwrap();
    w.set(format!("{a}.attention.layer_norm_rms_epsilon"), Value::F32(1e-6)).unwrap();
    w.set(format!("{a}.rope.freq_base"), Value::F32(1_000_000.0)).unwrap();
    for (k, v) in &spec.extra {
        w.set(format!("{a}.{k}"), v.clone()).unwrap();
    }

    let mut rng = StdRng::seed_from_u64(seed);
    let e = spec.n_embd;
    let hd = e / spec.n_head as u64;
    let (q, kv, ff) = (e, hd * spec.n_head_kv as u64, spec.n_ff);
    let mat = |w: &mut GgufWriter, rng: &mut StdRng, name: String, rows_in: u64, rows_out: u64| {
        let scale = 1.0 / (rows_in as f32).sqrt();
        let data = random(rng, (rows_in * rows_out) as usize, 0.0, scale * 1.7);
        w.add_tensor(name, GgmlType::F16, &[rows_in, rows_out], f16_bytes(&data)).unwrap();
    };
    let vec = |w: &mut GgufWriter, rng: &mut StdRng, name: String, n: u64, center: f32, spread: f32| {
        w.add_tensor(name, GgmlType::F32, &[n], f32_bytes(&random(rng, n as usize, center, spread))).unwrap();
    };
    // Embedding rows of unit-ish scale so activations are not vanishingly small.
    let embd = random(&mut rng, (e * n_vocab) as usize, 0.0, 1.0);
    w.add_tensor("token_embd.weight", GgmlType::F16, &[e, n_vocab], f16_bytes(&embd)).unwrap();
    vec(&mut w, &mut rng, "output_norm.weight".into(), e, 1.0, 0.2);
    if !spec.tied_output {
        mat(&mut w, &mut rng, "output.weight".into(), e, n_vocab);
    }
    for il in 0..spec.n_layer {
        let t = |n: &str| format!("blk.{il}.{n}");
        vec(&mut w, &mut rng, t("attn_norm.weight"), e, 1.0, 0.2);
        mat(&mut w, &mut rng, t("attn_q.weight"), e, q);
        mat(&mut w, &mut rng, t("attn_k.weight"), e, kv);
        mat(&mut w, &mut rng, t("attn_v.weight"), e, kv);
        mat(&mut w, &mut rng, t("attn_output.weight"), q, e);
        if spec.qkv_bias {
            vec(&mut w, &mut rng, t("attn_q.bias"), q, 0.0, 0.5);
            vec(&mut w, &mut rng, t("attn_k.bias"), kv, 0.0, 0.5);
            vec(&mut w, &mut rng, t("attn_v.bias"), kv, 0.0, 0.5);
        }
        if spec.qk_norm {
            vec(&mut w, &mut rng, t("attn_q_norm.weight"), hd, 1.0, 0.3);
            vec(&mut w, &mut rng, t("attn_k_norm.weight"), hd, 1.0, 0.3);
        }
        vec(&mut w, &mut rng, t("ffn_norm.weight"), e, 1.0, 0.2);
        mat(&mut w, &mut rng, t("ffn_gate.weight"), e, ff);
        mat(&mut w, &mut rng, t("ffn_up.weight"), e, ff);
        mat(&mut w, &mut rng, t("ffn_down.weight"), ff, e);
    }
    let path = dir.join(format!("tiny-{a}-{seed}.gguf"));
    w.write_to(&path).unwrap();
    path
}
