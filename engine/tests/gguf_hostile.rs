//! The GGUF reader against the real default model and against hostile variations of
//! it: the model must parse to what llama.cpp reports for it, and no mutation or
//! truncation of its header may panic or yield tensor ranges outside the file.

mod common;

use std::io::Read;
use std::sync::OnceLock;

use engine::gguf::{parse, GgmlType, GgufFile, GgufMeta, GgufWriter, Value, ValueType};
use engine::Error;
use proptest::prelude::*;

/// Where the default model's tensor data starts: header, metadata and tensor infos
/// all lie before it, so the mutation tests only need a prefix covering it.
const MODEL_DATA_OFFSET: usize = 1_785_664;
const PREFIX_LEN: usize = 2 << 20;
/// The tensor infos of the default model (272 of them) fit in the last 24 KiB of
/// the header; mutations aimed there exercise tensor validation.
const TENSOR_INFO_ZONE: std::ops::Range<usize> = MODEL_DATA_OFFSET - 24 * 1024..MODEL_DATA_OFFSET;

fn model_prefix() -> &'static [u8] {
    static PREFIX: OnceLock<Vec<u8>> = OnceLock::new();
    PREFIX.get_or_init(|| {
        let path = common::default_model();
        let file =
            std::fs::File::open(&path).unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
        let mut prefix = Vec::with_capacity(PREFIX_LEN);
        file.take(PREFIX_LEN as u64)
            .read_to_end(&mut prefix)
            .expect("read model prefix");
        assert_eq!(
            prefix.len(),
            PREFIX_LEN,
            "default model is smaller than expected"
        );
        prefix
    })
}

/// What parse promises when it succeeds: every tensor lies, aligned, inside the bytes.
fn assert_sound(meta: &GgufMeta, len: usize) {
    assert!(meta.alignment().is_power_of_two());
    assert_eq!(meta.data_offset() % meta.alignment(), 0);
    for t in meta.tensors() {
        assert_eq!(t.offset % meta.alignment(), 0);
        let end = meta.data_offset() + t.offset + t.n_bytes;
        assert!(
            end <= len as u64,
            "tensor `{}` ends at {end}, past {len}",
            t.name
        );
    }
}

#[test]
fn real_model_parses_to_what_llama_cpp_reports() {
    let file = GgufFile::open(common::default_model()).expect("default model parses");
    let meta = file.meta();
    assert_eq!(meta.version(), 3);
    assert_eq!(meta.tensors().len(), 272);
    assert_eq!(meta.alignment(), 32);
    assert_eq!(meta.data_offset(), MODEL_DATA_OFFSET as u64);
    assert_eq!(file.get_str("general.architecture"), Some("llama"));
    assert_eq!(file.get_u64("llama.block_count"), Some(30));
    let tokens = file
        .get("tokenizer.ggml.tokens")
        .and_then(Value::as_array)
        .expect("token list");
    assert_eq!(tokens.len(), 49152);

    let embd = file.tensor("token_embd.weight").expect("token_embd.weight");
    assert_eq!(
        (embd.ty, &embd.dims[..]),
        (GgmlType::Q8_0, &[576, 49152][..])
    );
    assert_eq!(file.tensor_bytes(embd).len(), 576 / 32 * 34 * 49152);
    let q = file
        .tensor("blk.0.attn_q.weight")
        .expect("blk.0.attn_q.weight");
    assert_eq!((q.ty, &q.dims[..]), (GgmlType::Q4_1, &[576, 576][..]));
    assert_eq!(file.tensor_bytes(q).len(), 576 / 32 * 20 * 576);
    for t in file.tensors() {
        assert_eq!(file.tensor_bytes(t).len() as u64, t.n_bytes, "{}", t.name);
    }
    assert_sound(meta, file.bytes().len());
}

#[test]
fn writer_reproduces_the_real_model() {
    let file = GgufFile::open(common::default_model()).expect("default model parses");
    let mut w = GgufWriter::from_meta(file.meta());
    for t in file.tensors() {
        w.add_tensor(t.name.clone(), t.ty, &t.dims, file.tensor_bytes(t).to_vec())
            .expect("copy tensor");
    }
    let bytes = w.to_bytes();
    let meta = parse(&bytes).expect("rewritten model parses");
    assert_eq!(&meta, file.meta());
    assert!(
        bytes[..] == file.bytes()[..],
        "rewritten model differs from the original"
    );
}

#[derive(Clone, Debug)]
enum Mutation {
    Flip { at: usize, bit: u8 },
    Fill { at: usize, len: usize },
    HugeU64 { at: usize, value: u64 },
    Truncate { at: usize },
    Insert { at: usize, bytes: Vec<u8> },
    Delete { at: usize, len: usize },
}

impl Mutation {
    /// Positions are clamped, not trusted: earlier mutations may have shortened the file.
    fn apply(&self, bytes: &mut Vec<u8>) {
        let clamp = |at: usize| at.min(bytes.len());
        match *self {
            Mutation::Flip { at, bit } => {
                if let Some(b) = bytes.get_mut(at) {
                    *b ^= 1 << (bit % 8);
                }
            }
            Mutation::Fill { at, len } => {
                let (start, end) = (clamp(at), clamp(at.saturating_add(len)));
                bytes[start..end].fill(0xFF);
            }
            Mutation::HugeU64 { at, value } => {
                let (start, end) = (clamp(at), clamp(at.saturating_add(8)));
                bytes[start..end].copy_from_slice(&value.to_le_bytes()[..end - start]);
            }
            Mutation::Truncate { at } => bytes.truncate(at),
            Mutation::Insert { at, bytes: ref ins } => {
                let at = clamp(at);
                bytes.splice(at..at, ins.iter().copied());
            }
            Mutation::Delete { at, len } => {
                let (start, end) = (clamp(at), clamp(at.saturating_add(len)));
                bytes.drain(start..end);
            }
        }
    }
}

/// Biased to where the structure is: the header and first metadata entries, the
/// header's count fields, and the tensor infos; the rest anywhere in `len` bytes.
fn position(len: usize, tensor_zone: std::ops::Range<usize>) -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => 0..4096usize.min(len),
        1 => prop::sample::select(vec![4usize, 8, 16, 24, 32]),
        3 => tensor_zone,
        2 => 0..len,
    ]
}

fn mutation(len: usize, tensor_zone: std::ops::Range<usize>) -> impl Strategy<Value = Mutation> {
    let huge = prop_oneof![
        Just(u64::MAX),
        Just(1u64 << 63),
        Just(1u64 << 40),
        Just(i64::MAX as u64 + 1),
        Just(u64::from(u32::MAX)),
        Just(0u64),
        any::<u64>(),
    ];
    let at = move || position(len, tensor_zone.clone());
    prop_oneof![
        (at(), any::<u8>()).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        (at(), 1..64usize).prop_map(|(at, len)| Mutation::Fill { at, len }),
        (at(), huge).prop_map(|(at, value)| Mutation::HugeU64 { at, value }),
        at().prop_map(|at| Mutation::Truncate { at }),
        (at(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        (at(), 1..16usize).prop_map(|(at, len)| Mutation::Delete { at, len }),
    ]
}

fn mutate_and_parse(original: &[u8], mutations: &[Mutation]) {
    let mut bytes = original.to_vec();
    mutations.iter().for_each(|m| m.apply(&mut bytes));
    if let Ok(meta) = parse(&bytes) {
        assert_sound(&meta, bytes.len());
    }
}

/// A small valid file with every kind of metadata and a few tensors, so mutations
/// also reach the paths that end in Ok.
fn small_model() -> Vec<u8> {
    let mut w = GgufWriter::new();
    let strings = ["<s>", "</s>", "héllo"].map(Value::from).to_vec();
    let nested = Value::Array {
        elem: ValueType::Array,
        items: vec![Value::Array {
            elem: ValueType::I32,
            items: vec![Value::I32(-1)],
        }],
    };
    for (k, v) in [
        ("general.architecture", Value::from("llama")),
        ("llama.block_count", Value::U32(1)),
        ("llama.rope.freq_base", Value::F32(10000.0)),
        (
            "tokenizer.ggml.tokens",
            Value::Array {
                elem: ValueType::String,
                items: strings,
            },
        ),
        ("tokenizer.ggml.add_bos_token", Value::Bool(true)),
        ("nested", nested),
    ] {
        w.set(k, v).expect("valid metadata");
    }
    w.add_tensor("a", GgmlType::F32, &[4, 2], vec![0; 32])
        .expect("f32");
    w.add_tensor("b", GgmlType::Q4_1, &[32], vec![0; 20])
        .expect("q4_1");
    w.add_tensor("c", GgmlType::Q8_0, &[64, 1, 2], vec![0; 136])
        .expect("q8_0");
    w.to_bytes()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn mutated_model_headers_never_panic(
        mutations in prop::collection::vec(mutation(PREFIX_LEN, TENSOR_INFO_ZONE), 1..=4)
    ) {
        mutate_and_parse(model_prefix(), &mutations);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4096, ..ProptestConfig::default() })]

    #[test]
    fn mutated_small_models_never_panic(
        mutations in prop::collection::vec(mutation(small_model().len(), 0..small_model().len()), 1..=4)
    ) {
        mutate_and_parse(&small_model(), &mutations);
    }
}

#[test]
fn every_truncation_of_the_real_header_is_an_error() {
    let prefix = model_prefix();
    let cuts = (0..512)
        .chain((512..=MODEL_DATA_OFFSET).step_by(4096))
        .chain([MODEL_DATA_OFFSET]);
    for len in cuts {
        assert!(parse(&prefix[..len]).is_err(), "{len}-byte prefix parsed");
    }
}

#[test]
fn open_reports_missing_and_empty_files() {
    let dir = std::env::temp_dir();
    let missing = dir.join(format!("gguf-hostile-missing-{}.gguf", std::process::id()));
    match GgufFile::open(&missing) {
        Err(e @ Error::Io { .. }) => {
            assert!(e.to_string().contains(&*missing.to_string_lossy()), "{e}")
        }
        other => panic!("expected Error::Io, got {other:?}"),
    }

    let empty = dir.join(format!("gguf-hostile-empty-{}.gguf", std::process::id()));
    std::fs::write(&empty, b"").expect("create empty file");
    let result = GgufFile::open(&empty);
    std::fs::remove_file(&empty).ok();
    match result {
        Err(Error::InvalidGguf { offset: 0, reason }) => {
            assert!(reason.contains("too short"), "{reason}")
        }
        other => panic!("expected Error::InvalidGguf, got {other:?}"),
    }
}

/// A split set missing a part, with a part renamed, with a part of another set, or whose
/// first part counts other tensors: each refused by naming the file and what is wrong.
#[test]
fn a_split_set_that_is_not_whole_is_refused_with_the_file_named() {
    let dir = std::env::temp_dir().join(format!("gguf-hostile-split-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let write = |name: &str, tensors: usize, max: u64| {
        let mut w = GgufWriter::new();
        w.set("general.architecture", Value::String("llama".into())).unwrap();
        for i in 0..tensors {
            w.add_tensor(format!("t{i}"), GgmlType::F32, &[64], vec![i as u8; 256]).unwrap();
        }
        w.write_split_streaming(&dir.join(name).to_string_lossy(), max, |_, _, _, _| {}).unwrap()
    };
    let parts = write("m", 3, 256);
    assert_eq!(parts.len(), 3);
    let whole = GgufFile::open(&parts[1]).expect("a whole set opens from any part");
    assert_eq!(whole.tensors().len(), 3);
    for (i, t) in whole.tensors().iter().enumerate() {
        assert_eq!(whole.tensor_bytes(t), &[i as u8; 256][..]);
    }
    assert_eq!(whole.parts().len(), 3);
    drop(whole);
    let refused = |path: &std::path::Path| GgufFile::open(path).expect_err("refused").to_string();

    std::fs::rename(&parts[2], dir.join("elsewhere.gguf")).unwrap();
    let e = refused(&parts[0]);
    assert!(e.contains("m-00003-of-00003.gguf is missing") && e.contains("same folder"), "{e}");
    let e = refused(&dir.join("elsewhere.gguf"));
    assert!(e.contains("does not follow") && e.contains("NAME-00003-of-00003.gguf"), "{e}");

    // Part 3 of another set of three, put in this one's place.
    let other = write("o", 4, 256);
    assert_eq!(other.len(), 4);
    std::fs::copy(&other[2], &parts[2]).unwrap();
    let e = refused(&parts[0]);
    assert!(e.contains("should be part 3 of 3") && e.contains("part 3 of 4"), "{e}");
    // A part that is a whole model.
    let mut plain = GgufWriter::new();
    plain.add_tensor("t2", GgmlType::F32, &[64], vec![2; 256]).unwrap();
    plain.write_to(&parts[2]).unwrap();
    assert!(refused(&parts[0]).contains("it is a whole model"));
    // Truncated: its tensors past its end.
    std::fs::copy(&parts[1], &parts[2]).unwrap();
    let bytes = std::fs::read(&parts[1]).unwrap();
    std::fs::write(&parts[1], &bytes[..bytes.len() - 100]).unwrap();
    let e = refused(&parts[0]);
    assert!(e.contains("m-00002-of-00003.gguf (part 2 of 3): invalid GGUF") && e.contains("past end of file"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}
