//! Structure-aware fuzzing of the GGUF reader and of what reads a model's metadata after
//! it (`ModelSpec::from_gguf`, `ModelFile`). Inputs are GGUF files held as their fields
//! (counts, string lengths, type ids, dimensions, offsets, values), so a mutation can make
//! one field lie while everything around it stays well-formed, which random bytes almost
//! never do; byte-level mutations run on top. Seeds are small valid files written by
//! `GgufWriter`, one of them a complete (tiny) llama model so mutants reach the spec checks.
//!
//! Promises checked: nothing panics or stalls; a file `parse` accepts has every tensor
//! aligned and inside it; `GgufFile::open` agrees with `parse` and hands out exactly each
//! tensor's bytes; what the reader accepts the writer can write back, to the same metadata
//! and tensor infos. `HEARTH_FUZZ_SECS=600` runs it for ten minutes (see docs/robustness.md).

#[path = "../../tests/fuzz_driver.rs"]
mod fuzz;

use std::path::PathBuf;
use std::time::Duration;

use engine::gguf::{parse, GgmlType, GgufFile, GgufMeta, GgufWriter, Value, ValueType, ALIGNMENT_KEY};
use engine::{ModelFile, ModelSpec};
use fuzz::{mutate_bytes, shape, Budget, Rng};

/// Parsing a few kilobytes takes microseconds; a case over this is a stall, not noise.
const STALL: Duration = Duration::from_secs(5);
/// Largest alignment whose files the writer round trip copies (see `check`).
const MAX_ROUND_TRIP_ALIGNMENT: u64 = 1 << 16;

/// A metadata value as the bytes after its type id, with lengths and counts that may lie.
#[derive(Clone, Debug)]
enum RawValue {
    /// Fixed-width scalars, as their little-endian bytes (the width may be wrong).
    Scalar(Vec<u8>),
    Str { len: Option<u64>, bytes: Vec<u8> },
    Array { elem: u32, count: Option<u64>, items: Vec<RawValue> },
}

#[derive(Clone, Debug)]
struct RawKv {
    key: Vec<u8>,
    key_len: Option<u64>,
    ty: u32,
    value: RawValue,
}

#[derive(Clone, Debug)]
struct RawTensor {
    name: Vec<u8>,
    name_len: Option<u64>,
    n_dims: Option<u32>,
    dims: Vec<u64>,
    ty: u32,
    offset: u64,
}

/// A GGUF file as fields; `None` counts and lengths mean "the true one".
#[derive(Clone, Debug)]
struct RawGguf {
    magic: [u8; 4],
    version: u32,
    n_tensors: Option<u64>,
    n_kv: Option<u64>,
    kvs: Vec<RawKv>,
    tensors: Vec<RawTensor>,
    /// The data section starts at the header's end rounded up to this (the writer uses the
    /// file's alignment); a lie here misplaces every tensor.
    pad_to: u64,
    data: Vec<u8>,
    /// Byte-level mutations applied after serialising, each as the seed of its choices.
    byte_edits: Vec<u64>,
}

fn put_str(out: &mut Vec<u8>, len: Option<u64>, bytes: &[u8]) {
    out.extend_from_slice(&len.unwrap_or(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}

fn put_value(out: &mut Vec<u8>, v: &RawValue) {
    match v {
        RawValue::Scalar(bytes) => out.extend_from_slice(bytes),
        RawValue::Str { len, bytes } => put_str(out, *len, bytes),
        RawValue::Array { elem, count, items } => {
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&count.unwrap_or(items.len() as u64).to_le_bytes());
            items.iter().for_each(|i| put_value(out, i));
        }
    }
}

impl RawGguf {
    fn to_bytes(&self) -> Vec<u8> {
        let mut out = self.magic.to_vec();
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&self.n_tensors.unwrap_or(self.tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&self.n_kv.unwrap_or(self.kvs.len() as u64).to_le_bytes());
        for kv in &self.kvs {
            put_str(&mut out, kv.key_len, &kv.key);
            out.extend_from_slice(&kv.ty.to_le_bytes());
            put_value(&mut out, &kv.value);
        }
        for t in &self.tensors {
            put_str(&mut out, t.name_len, &t.name);
            out.extend_from_slice(&t.n_dims.unwrap_or(t.dims.len() as u32).to_le_bytes());
            t.dims.iter().for_each(|d| out.extend_from_slice(&d.to_le_bytes()));
            out.extend_from_slice(&t.ty.to_le_bytes());
            out.extend_from_slice(&t.offset.to_le_bytes());
        }
        // A lying pad_to is capped so a mutant cannot ask for gigabytes of padding.
        let pad_to = self.pad_to.clamp(1, 1 << 16) as usize;
        out.resize(out.len().div_ceil(pad_to) * pad_to, 0);
        out.extend_from_slice(&self.data);
        for &edit in &self.byte_edits {
            mutate_bytes(&mut Rng::new(edit), &mut out, &[]);
        }
        out
    }

    /// The fields of a file `parse` accepted.
    fn from_valid(bytes: &[u8]) -> RawGguf {
        let meta = parse(bytes).expect("seed parses");
        let kvs = meta
            .metadata()
            .iter()
            .map(|(k, v)| RawKv { key: k.as_bytes().to_vec(), key_len: None, ty: v.value_type() as u32, value: raw_value(v) })
            .collect();
        let tensors = meta
            .tensors()
            .iter()
            .map(|t| RawTensor {
                name: t.name.as_bytes().to_vec(),
                name_len: None,
                n_dims: None,
                dims: t.dims.clone(),
                ty: t.ty.id(),
                offset: t.offset,
            })
            .collect();
        RawGguf {
            magic: *b"GGUF",
            version: meta.version(),
            n_tensors: None,
            n_kv: None,
            kvs,
            tensors,
            pad_to: meta.alignment(),
            data: bytes[meta.data_offset() as usize..].to_vec(),
            byte_edits: Vec::new(),
        }
    }
}

fn raw_value(v: &Value) -> RawValue {
    let le = |b: &[u8]| RawValue::Scalar(b.to_vec());
    match v {
        Value::U8(x) => le(&x.to_le_bytes()),
        Value::I8(x) => le(&x.to_le_bytes()),
        Value::U16(x) => le(&x.to_le_bytes()),
        Value::I16(x) => le(&x.to_le_bytes()),
        Value::U32(x) => le(&x.to_le_bytes()),
        Value::I32(x) => le(&x.to_le_bytes()),
        Value::U64(x) => le(&x.to_le_bytes()),
        Value::I64(x) => le(&x.to_le_bytes()),
        Value::F32(x) => le(&x.to_le_bytes()),
        Value::F64(x) => le(&x.to_le_bytes()),
        Value::Bool(x) => le(&[u8::from(*x)]),
        Value::String(s) => RawValue::Str { len: None, bytes: s.as_bytes().to_vec() },
        Value::Array { elem, items } => {
            RawValue::Array { elem: *elem as u32, count: None, items: items.iter().map(raw_value).collect() }
        }
    }
}

/// A count or length that lies: off by one either way, or an edge value.
fn lie(rng: &mut Rng, truth: u64) -> u64 {
    match rng.below(3) {
        0 => truth.wrapping_add(1),
        1 => truth.wrapping_sub(1),
        _ => rng.interesting_u64(),
    }
}

/// Type ids near the valid ones (a neighbour is the likeliest corruption) or anything.
fn type_id(rng: &mut Rng, valid_below: u32) -> u32 {
    if rng.one_in(4) {
        rng.next_u64() as u32
    } else {
        rng.below(valid_below as usize + 3) as u32
    }
}

/// Keys the model code looks up, so mutants collide with the ones that matter.
const HOT_KEYS: &[&str] = &[
    ALIGNMENT_KEY,
    "general.architecture",
    "llama.block_count",
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.attention.head_count_kv",
    "llama.attention.key_length",
    "llama.attention.value_length",
    "llama.rope.dimension_count",
    "llama.rope.scaling.type",
    "llama.rope.scaling.factor",
    "llama.context_length",
    "llama.attention.temperature_scale",
];

fn mutate_value(rng: &mut Rng, v: &mut RawValue, depth: usize) {
    match v {
        RawValue::Scalar(bytes) => match rng.below(3) {
            0 => *bytes = rng.interesting_u64().to_le_bytes()[..bytes.len().clamp(1, 8)].to_vec(),
            1 => bytes.truncate(rng.below(bytes.len() + 1)),
            _ => *bytes = rng.interesting_u64().to_le_bytes()[..1 << rng.below(4)].to_vec(),
        },
        RawValue::Str { len, bytes } => match rng.below(4) {
            0 => *len = Some(lie(rng, bytes.len() as u64)),
            1 => bytes.push(*rng.pick(&[0xFF, 0xC3, 0x80, 0, b'\n'])),
            2 => *bytes = rng.pick(&["llama", "qwen3", "yarn", "none", "", "mistral"]).as_bytes().to_vec(),
            _ => bytes.truncate(rng.below(bytes.len() + 1)),
        },
        RawValue::Array { elem, count, items } => match rng.below(5) {
            0 => *count = Some(lie(rng, items.len() as u64)),
            1 => *elem = type_id(rng, 13),
            2 if !items.is_empty() => {
                let i = rng.below(items.len());
                mutate_value(rng, &mut items[i], depth + 1)
            }
            3 => {
                // Deeper nesting, up to past the reader's limit.
                if depth < 12 {
                    let inner = std::mem::take(items);
                    let old_elem = *elem;
                    items.push(RawValue::Array { elem: old_elem, count: None, items: inner });
                    *elem = ValueType::Array as u32;
                }
            }
            _ => {
                if let Some(last) = items.last().cloned() {
                    items.push(last);
                } else {
                    items.clear();
                }
            }
        },
    }
}

fn mutate_kv(rng: &mut Rng, kv: &mut RawKv) {
    match rng.below(6) {
        0 => kv.key_len = Some(lie(rng, kv.key.len() as u64)),
        1 => kv.key = rng.pick(HOT_KEYS).as_bytes().to_vec(),
        2 => kv.key = rng.pick(&[&b""[..], b"\xff\xfe", b"a\0b", b"general.alignment"]).to_vec(),
        3 => kv.ty = type_id(rng, 13),
        _ => mutate_value(rng, &mut kv.value, 0),
    }
}

fn mutate_tensor(rng: &mut Rng, t: &mut RawTensor, alignment: u64) {
    match rng.below(8) {
        0 => t.name_len = Some(lie(rng, t.name.len() as u64)),
        1 => t.n_dims = Some(if rng.one_in(2) { rng.below(7) as u32 } else { rng.next_u64() as u32 }),
        2 if !t.dims.is_empty() => {
            let d = rng.below(t.dims.len());
            t.dims[d] = if rng.one_in(2) { lie(rng, t.dims[d]) } else { t.dims[d] * (1 + rng.below(4) as u64) };
        }
        3 => {
            if t.dims.len() < 6 && rng.one_in(2) {
                t.dims.push(1 + rng.below(3) as u64);
            } else {
                t.dims.pop();
            }
        }
        4 => t.ty = type_id(rng, 43),
        5 => t.offset = lie(rng, t.offset),
        6 => t.offset = t.offset.wrapping_add(alignment * rng.below(4) as u64),
        _ => t.name = rng.pick(&[&b"token_embd.weight"[..], b"output.weight", b"", b"\xff", b"blk.0.attn_q.weight"]).to_vec(),
    }
}

fn mutate(rng: &mut Rng, parent: &RawGguf, donor: &RawGguf) -> RawGguf {
    let mut g = parent.clone();
    for _ in 0..1 + rng.below(3) {
        match rng.below(16) {
            0 => g.version = *rng.pick(&[1, 2, 3, 4, 0x0300_0000, u32::MAX]),
            1 => g.magic[rng.below(4)] ^= 1 << rng.below(8),
            2 => g.n_tensors = Some(lie(rng, g.tensors.len() as u64)),
            3 => g.n_kv = Some(lie(rng, g.kvs.len() as u64)),
            4..=6 if !g.kvs.is_empty() => {
                let i = rng.below(g.kvs.len());
                mutate_kv(rng, &mut g.kvs[i]);
            }
            7..=9 if !g.tensors.is_empty() => {
                let i = rng.below(g.tensors.len());
                let align = g.pad_to;
                mutate_tensor(rng, &mut g.tensors[i], align);
            }
            10 => {
                // Entries removed, duplicated or reordered.
                let list = rng.below(2);
                let n = if list == 0 { g.kvs.len() } else { g.tensors.len() };
                if n > 0 {
                    let (i, j) = (rng.below(n), rng.below(n));
                    match (list, rng.below(3)) {
                        (0, 0) => drop(g.kvs.remove(i)),
                        (0, 1) => g.kvs.push(g.kvs[i].clone()),
                        (0, _) => g.kvs.swap(i, j),
                        (_, 0) => drop(g.tensors.remove(i)),
                        (_, 1) => g.tensors.push(g.tensors[i].clone()),
                        _ => g.tensors.swap(i, j),
                    }
                }
            }
            11 => {
                // The alignment key set to an edge, stated or not in the padding.
                let a = *rng.pick(&[0u32, 1, 3, 8, 32, 64, 4096, 1 << 31, u32::MAX]);
                g.kvs.retain(|kv| kv.key != ALIGNMENT_KEY.as_bytes());
                let at = rng.below(g.kvs.len() + 1);
                let kv = RawKv {
                    key: ALIGNMENT_KEY.as_bytes().to_vec(),
                    key_len: None,
                    ty: ValueType::U32 as u32,
                    value: RawValue::Scalar(a.to_le_bytes().to_vec()),
                };
                g.kvs.insert(at, kv);
                if rng.one_in(2) {
                    g.pad_to = u64::from(a);
                }
            }
            12 => g.pad_to = *rng.pick(&[1, 8, 16, 32, 64, 4096]),
            13 => {
                let len = g.data.len();
                match rng.below(3) {
                    0 => g.data.truncate(rng.below(len + 1)),
                    1 => g.data.resize(len + 1 + rng.below(128), 0),
                    _ => g.data.truncate(len.saturating_sub(1)),
                }
            }
            14 => {
                // Crossover: the other file's metadata or tensors.
                if rng.one_in(2) {
                    g.kvs = donor.kvs.clone();
                } else {
                    g.tensors = donor.tensors.clone();
                    g.data = donor.data.clone();
                }
            }
            _ => g.byte_edits.push(rng.next_u64()),
        }
    }
    g
}

fn small_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    let strings = ["<s>", "</s>", "héllo"].map(Value::from).to_vec();
    let nested = Value::Array {
        elem: ValueType::Array,
        items: vec![Value::Array { elem: ValueType::I32, items: vec![Value::I32(-1)] }],
    };
    let kvs = [
        ("general.name", Value::from("fuzz")),
        ("u8", Value::U8(1)),
        ("i16", Value::I16(-2)),
        ("u64", Value::U64(1 << 40)),
        ("f64", Value::F64(0.5)),
        ("flag", Value::Bool(true)),
        ("tokenizer.ggml.tokens", Value::Array { elem: ValueType::String, items: strings }),
        ("nested", nested),
        ("empty", Value::Array { elem: ValueType::F32, items: vec![] }),
    ];
    for (k, v) in kvs {
        w.set(k, v).expect("valid metadata");
    }
    w.add_tensor("a", GgmlType::F32, &[4, 2], vec![1; 32]).expect("f32");
    w.add_tensor("b", GgmlType::Q4_1, &[32], vec![2; 20]).expect("q4_1");
    w.add_tensor("c", GgmlType::Q8_0, &[64, 1, 2], vec![3; 136]).expect("q8_0");
    w.add_tensor("d", GgmlType::F16, &[2, 2, 2, 2], vec![4; 32]).expect("f16");
    w.to_bytes()
}

/// The smallest llama `ModelSpec::from_gguf` accepts: one layer, n_embd 32, 4 heads
/// (2 KV heads), a vocabulary of 8, with weights of the right shapes.
fn tiny_llama() -> Vec<u8> {
    tiny_llama_with(&[])
}

/// `tiny_llama` with more metadata.
fn tiny_llama_with(extra: &[(&str, Value)]) -> Vec<u8> {
    let (e, ff, vocab, heads, kv_heads) = (32u64, 64u64, 8u64, 4u32, 2u32);
    let kv = e / u64::from(heads) * u64::from(kv_heads);
    let mut w = GgufWriter::new();
    let kvs = [
        ("general.architecture", Value::from("llama")),
        ("llama.block_count", Value::U32(1)),
        ("llama.context_length", Value::U32(256)),
        ("llama.embedding_length", Value::U32(e as u32)),
        ("llama.feed_forward_length", Value::U32(ff as u32)),
        ("llama.attention.head_count", Value::U32(heads)),
        ("llama.attention.head_count_kv", Value::U32(kv_heads)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.rope.freq_base", Value::F32(10000.0)),
        ("llama.rope.scaling.type", Value::from("linear")),
    ];
    for (k, v) in kvs.into_iter().chain(extra.iter().cloned()) {
        w.set(k, v).expect("valid metadata");
    }
    let mut add = |name: &str, dims: &[u64]| {
        let n: u64 = dims.iter().product();
        w.add_tensor(name, GgmlType::F32, dims, vec![0; n as usize * 4]).expect("tensor");
    };
    add("token_embd.weight", &[e, vocab]);
    add("output_norm.weight", &[e]);
    for (name, dims) in [
        ("attn_norm", vec![e]),
        ("attn_q", vec![e, e]),
        ("attn_k", vec![e, kv]),
        ("attn_v", vec![e, kv]),
        ("attn_output", vec![e, e]),
        ("ffn_norm", vec![e]),
        ("ffn_gate", vec![e, ff]),
        ("ffn_up", vec![e, ff]),
        ("ffn_down", vec![ff, e]),
    ] {
        add(&format!("blk.0.{name}.weight"), &dims);
    }
    w.to_bytes()
}

/// An error's kind: digits and quoted names (which a mutant can make anything) stripped.
fn error_shape(e: &engine::Error) -> String {
    let text = match e {
        engine::Error::InvalidGguf { reason, .. } => reason.clone(),
        other => other.to_string(),
    };
    let mut out = String::new();
    for (i, part) in text.split('`').enumerate() {
        out.push_str(if i % 2 == 0 { part } else { "`…`" });
    }
    shape(&out)
}

/// What `parse` promises when it succeeds.
fn assert_sound(meta: &GgufMeta, len: usize) {
    assert!(meta.alignment().is_power_of_two(), "alignment {}", meta.alignment());
    assert_eq!(meta.data_offset() % meta.alignment(), 0, "data offset unaligned");
    assert!(meta.data_offset() <= len as u64 + meta.alignment(), "data offset past the file");
    for t in meta.tensors() {
        assert_eq!(t.offset % meta.alignment(), 0, "tensor `{}` unaligned", t.name);
        let end = meta.data_offset().checked_add(t.offset).and_then(|s| s.checked_add(t.n_bytes));
        assert!(end.is_some_and(|end| end <= len as u64), "tensor `{}` past the end of {len} bytes", t.name);
        assert_eq!(meta.tensor(&t.name), Some(t), "tensor `{}` not found by name", t.name);
        assert!(!t.dims.is_empty() && t.dims.len() <= 4 && t.dims.iter().all(|&d| d > 0), "dims {:?}", t.dims);
    }
    for (k, v) in meta.metadata() {
        // By address: a NaN value is not equal to itself.
        assert!(meta.get(k).is_some_and(|found| std::ptr::eq(found, v)), "key `{k}` not found by name");
    }
}

/// One file per test process: cases run one at a time.
fn scratch_path() -> PathBuf {
    std::env::temp_dir().join(format!("hearth-gguf-fuzz-{}.gguf", std::process::id()))
}

fn check(raw: &RawGguf) -> String {
    let bytes = raw.to_bytes();
    let meta = match parse(&bytes) {
        Err(e) => return format!("parse: {}", error_shape(&e)),
        Ok(meta) => meta,
    };
    assert_sound(&meta, bytes.len());

    // What the reader accepts the writer writes back, to the same metadata and infos.
    let path = scratch_path();
    std::fs::write(&path, &bytes).expect("write scratch file");
    let file = GgufFile::open(&path).expect("a file parse accepted opens");
    // Compared as Debug text: NaN values are not equal to themselves, but print alike.
    // Field by field: the name indexes are hash maps, which print in any order.
    let same = |a: &GgufMeta, b: &GgufMeta| {
        let fields = |m: &GgufMeta| format!("{:?}", (m.version(), m.metadata(), m.tensors(), m.alignment(), m.data_offset()));
        fields(a) == fields(b)
    };
    assert!(same(file.meta(), &meta), "open and parse disagree");
    for t in meta.tensors() {
        assert_eq!(file.tensor_bytes(t).len() as u64, t.n_bytes, "tensor `{}` bytes", t.name);
    }
    // The writer pads every tensor to the file's alignment, so a file that declares 2^31
    // would be copied as gigabytes of zeros: the round trip is for ordinary alignments.
    if meta.alignment() <= MAX_ROUND_TRIP_ALIGNMENT {
        let mut w = GgufWriter::from_meta(&meta);
        for t in meta.tensors() {
            w.add_tensor(t.name.clone(), t.ty, &t.dims, file.tensor_bytes(t).to_vec())
                .unwrap_or_else(|e| panic!("the writer refuses a tensor the reader accepted: {e}"));
        }
        let again = parse(&w.to_bytes()).unwrap_or_else(|e| panic!("the writer's copy does not parse: {e}"));
        let metadata = |m: &GgufMeta| format!("{:?}", m.metadata());
        assert_eq!(metadata(&again), metadata(&meta), "metadata changed in a round trip");
        let infos = |m: &GgufMeta| m.tensors().iter().map(|t| (t.name.clone(), t.dims.clone(), t.ty)).collect::<Vec<_>>();
        assert_eq!(infos(&again), infos(&meta), "tensor infos changed in a round trip");
    }

    let outcome = match ModelSpec::from_gguf(&file) {
        Err(e) => format!("spec: {}", error_shape(&e)),
        Ok(spec) => {
            assert!(spec.n_layer > 0 && spec.n_embd > 0 && spec.n_head > 0 && spec.head_dim > 0, "{spec:?}");
            let model = ModelFile::open(&path).expect("a file whose spec loads opens as a model");
            assert_eq!(model.fingerprint().len(), 64);
            format!("spec ok: {:?} layers {}", spec.arch, spec.n_layer.min(2))
        }
    };
    format!("ok ({} tensors) {outcome}", meta.tensors().len().min(3))
}

#[test]
fn gguf_reader_and_model_spec_survive_hostile_files() {
    let seeds = vec![RawGguf::from_valid(&small_file()), RawGguf::from_valid(&tiny_llama())];
    // The unmutated tiny model must get through the whole chain, or mutants never will.
    assert!(check(&seeds[1]).contains("spec ok"), "tiny llama seed: {}", check(&seeds[1]));
    let report = fuzz::run("gguf", &Budget::from_env(1.0), seeds, STALL, mutate, check);
    std::fs::remove_file(scratch_path()).ok();
    assert!(report.outcomes > 20, "the fuzzer reached only {} outcomes: is it mutating?", report.outcomes);
}

/// Found reading `ModelSpec::from_gguf` for the fuzzer's promises: `attention.key_length`
/// was the one size taken from metadata without the `MAX_DIMENSION` bound the others get,
/// and `n_embd_q() = head_dim * n_head` then overflowed (a panic with overflow checks, a
/// refusal naming no such size without).
/// One part of a split model is refused by saying so (not as a missing tensor).
#[test]
fn a_part_of_a_split_model_is_refused_by_saying_so() {
    let bytes = tiny_llama_with(&[("split.no", Value::U16(0)), ("split.count", Value::U16(3)), ("split.tensors.count", Value::I32(9))]);
    let path = std::env::temp_dir().join(format!("hearth-split-part-{}.gguf", std::process::id()));
    std::fs::write(&path, bytes).expect("write");
    let err = engine::ModelFile::open(&path).expect_err("a split part is refused");
    std::fs::remove_file(&path).ok();
    assert!(err.to_string().contains("part 1 of a model split into 3 files"), "{err}");
}

#[test]
fn an_absurd_head_size_is_refused_by_name() {
    let bytes = tiny_llama_with(&[("llama.attention.key_length", Value::U64(1 << 62))]);
    let path = std::env::temp_dir().join(format!("hearth-head-size-{}.gguf", std::process::id()));
    std::fs::write(&path, bytes).expect("write");
    let file = GgufFile::open(&path).expect("opens");
    std::fs::remove_file(&path).ok();
    let err = ModelSpec::from_gguf(&file).expect_err("a 2^62-wide head is refused");
    assert!(err.to_string().contains("attention.key_length"), "the error should name the key: {err}");
}
