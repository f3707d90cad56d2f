//! Writing GGUF v3 files: small test models, and real metadata copied onto new tensors.
//! Everything the reader would reject is refused when it is added, so writing itself
//! cannot produce an invalid file.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use super::reader::{GgufMeta, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC};
use super::tensor_type::GgmlType;
use super::value::Value;
use crate::{Error, Result};

const WRITE_VERSION: u32 = 3;

#[derive(Clone, Debug, Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

#[derive(Clone, Debug)]
struct PendingTensor {
    name: String,
    ty: GgmlType,
    dims: Vec<u64>,
    /// Empty for a tensor whose bytes come at write time ([`GgufWriter::add_tensor_later`]).
    data: Vec<u8>,
    len: u64,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// All of `meta`'s metadata, in order, and none of its tensors.
    pub fn from_meta(meta: &GgufMeta) -> Self {
        GgufWriter {
            metadata: meta.metadata().to_vec(),
            tensors: Vec::new(),
        }
    }

    /// Sets `key`, replacing an existing value in place so key order is kept.
    pub fn set(&mut self, key: impl Into<String>, value: Value) -> Result<()> {
        let key = key.into();
        let refuse = |reason: String| {
            Err(Error::Metadata {
                key: key.clone(),
                reason,
            })
        };
        if key.is_empty() {
            return refuse("GGUF keys cannot be empty".into());
        }
        if key == ALIGNMENT_KEY && !matches!(value, Value::U32(a) if a.is_power_of_two()) {
            return refuse(format!("must be a u32 power of two, got {value:?}"));
        }
        if let Some(reason) = value.shape_error() {
            return refuse(reason);
        }
        match self.metadata.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => *v = value,
            None => self.metadata.push((key, value)),
        }
        Ok(())
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn remove(&mut self, key: &str) -> Option<Value> {
        let i = self.metadata.iter().position(|(k, _)| k == key)?;
        Some(self.metadata.remove(i).1)
    }

    /// `dims` in ggml `ne` order; `data` must be exactly the tensor's size.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        ty: GgmlType,
        dims: &[u64],
        data: Vec<u8>,
    ) -> Result<()> {
        let name = name.into();
        let refuse = |reason: String| {
            Err(Error::Tensor {
                name: name.clone(),
                reason,
            })
        };
        if self.tensors.iter().any(|t| t.name == name) {
            return refuse("duplicate tensor name".into());
        }
        let expected = match ty.tensor_bytes(dims) {
            Ok(n) => n,
            Err(why) => return refuse(why),
        };
        if data.len() as u64 != expected {
            return refuse(format!(
                "data is {} bytes, {ty} {dims:?} needs {expected}",
                data.len()
            ));
        }
        self.tensors.push(PendingTensor {
            name,
            ty,
            dims: dims.to_vec(),
            data,
            len: expected,
        });
        Ok(())
    }

    /// Declares a tensor whose bytes [`write_streaming`](Self::write_streaming) asks for
    /// when it writes it, so a file larger than memory can be written one tensor at a time.
    pub fn add_tensor_later(&mut self, name: impl Into<String>, ty: GgmlType, dims: &[u64]) -> Result<()> {
        let name = name.into();
        let refuse = |reason: String| Err(Error::Tensor { name: name.clone(), reason });
        if self.tensors.iter().any(|t| t.name == name) {
            return refuse("duplicate tensor name".into());
        }
        let len = match ty.tensor_bytes(dims) {
            Ok(n) => n,
            Err(why) => return refuse(why),
        };
        self.tensors.push(PendingTensor { name, ty, dims: dims.to_vec(), data: Vec::new(), len });
        Ok(())
    }

    /// Writes the file; `fill(name, ty, dims, buf)` gets a zeroed buffer of the tensor's
    /// exact size for each tensor added with [`add_tensor_later`](Self::add_tensor_later)
    /// and writes its bytes into it. One such buffer is alive at a time.
    pub fn write_streaming(&self, path: impl AsRef<Path>, mut fill: impl FnMut(&str, GgmlType, &[u64], &mut [u8])) -> Result<()> {
        let path = path.as_ref();
        let io = |source| Error::Io { path: path.to_path_buf(), source };
        let mut w = BufWriter::with_capacity(1 << 20, File::create(path).map_err(io)?);
        let header = self.header();
        w.write_all(&header).map_err(io)?;
        let mut written = header.len() as u64;
        let mut buf = Vec::new();
        for t in &self.tensors {
            if t.data.len() as u64 == t.len {
                w.write_all(&t.data).map_err(io)?;
            } else {
                buf.clear();
                buf.resize(t.len as usize, 0);
                fill(&t.name, t.ty, &t.dims, &mut buf);
                w.write_all(&buf).map_err(io)?;
            }
            written += t.len;
            let pad = padded(written, self.alignment()) - written;
            w.write_all(&vec![0; pad as usize]).map_err(io)?;
            written += pad;
        }
        w.into_inner().map_err(|e| io(e.into_error()))?.sync_all().map_err(io)
    }

    /// Writes the model as a split set, llama.cpp's `gguf-split --split-max-size` layout:
    /// `PREFIX-00001-of-0000N.gguf` and on, each part's tensor data at most `max_bytes`
    /// (a part holds at least one tensor, however large), the first part with all the
    /// metadata, every part with `split.no`, `split.count` and `split.tensors.count`.
    /// `fill` is asked for tensors as in [`write_streaming`](Self::write_streaming).
    /// Returns the parts' paths in order.
    pub fn write_split_streaming(&self, prefix: &str, max_bytes: u64, mut fill: impl FnMut(&str, GgmlType, &[u64], &mut [u8])) -> Result<Vec<std::path::PathBuf>> {
        use super::split::{part_name, MAX_PARTS, SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS_COUNT};
        let mut groups: Vec<Vec<&PendingTensor>> = vec![Vec::new()];
        let mut size = 0;
        for t in &self.tensors {
            let group = groups.last_mut().expect("one group at least");
            if !group.is_empty() && size + t.len > max_bytes {
                groups.push(Vec::new());
                size = 0;
            }
            groups.last_mut().expect("pushed").push(t);
            size += padded(t.len, self.alignment());
        }
        let count = groups.len() as u64;
        if count > MAX_PARTS {
            return Err(Error::InvalidModel(format!("{count} parts of at most {max_bytes} bytes: more than the {MAX_PARTS} a split set may have")));
        }
        let n_tensors = i32::try_from(self.tensors.len()).map_err(|_| Error::InvalidModel("too many tensors for split.tensors.count".into()))?;
        let mut paths = Vec::new();
        for (k, group) in groups.into_iter().enumerate() {
            let mut part = if k == 0 { GgufWriter { metadata: self.metadata.clone(), tensors: Vec::new() } } else { GgufWriter::new() };
            if k > 0 {
                if let Some(align) = self.get(ALIGNMENT_KEY) {
                    part.set(ALIGNMENT_KEY, align.clone())?;
                }
            }
            part.set(SPLIT_NO, Value::U16(k as u16))?;
            part.set(SPLIT_COUNT, Value::U16(count as u16))?;
            part.set(SPLIT_TENSORS_COUNT, Value::I32(n_tensors))?;
            part.tensors = group.into_iter().cloned().collect();
            let path = std::path::PathBuf::from(part_name(prefix, k as u64 + 1, count));
            part.write_streaming(&path, &mut fill)?;
            paths.push(path);
        }
        Ok(paths)
    }

    /// `general.alignment` if set, else the GGUF default.
    pub fn alignment(&self) -> u64 {
        match self.get(ALIGNMENT_KEY) {
            Some(Value::U32(a)) => (*a).into(),
            _ => DEFAULT_ALIGNMENT,
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = self.header();
        for t in &self.tensors {
            out.extend_from_slice(&t.data);
            // A tensor added for later writing is zeros here.
            out.resize(out.len() + (t.len as usize - t.data.len()), 0);
            out.resize(padded(out.len() as u64, self.alignment()) as usize, 0);
        }
        out
    }

    /// Writes the file (tensors added for later writing are zeros).
    pub fn write_to(&self, path: impl AsRef<Path>) -> Result<()> {
        self.write_streaming(path, |_, _, _, _| {})
    }

    /// Everything before the tensor data, padded to the start of the data section.
    fn header(&self) -> Vec<u8> {
        let align = self.alignment();
        let mut out = GGUF_MAGIC.to_vec();
        put_u32(&mut out, WRITE_VERSION);
        put_u64(&mut out, self.tensors.len() as u64);
        put_u64(&mut out, self.metadata.len() as u64);
        for (key, value) in &self.metadata {
            put_str(&mut out, key);
            put_u32(&mut out, value.value_type() as u32);
            put_value(&mut out, value);
        }
        let mut offset = 0;
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            put_u32(&mut out, t.dims.len() as u32);
            t.dims.iter().for_each(|&d| put_u64(&mut out, d));
            put_u32(&mut out, t.ty.id());
            put_u64(&mut out, offset);
            offset = padded(offset + t.len, align);
        }
        out.resize(padded(out.len() as u64, align) as usize, 0);
        out
    }
}

/// `n` rounded up to a multiple of `align`, a power of two (set() guarantees it).
fn padded(n: u64, align: u64) -> u64 {
    n.div_ceil(align) * align
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_u64(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

/// The value without its type tag (the caller or the enclosing array wrote it).
fn put_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => out.push(*v),
        Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => put_u32(out, *v),
        Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U64(v) => put_u64(out, *v),
        Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::String(s) => put_str(out, s),
        Value::Array { elem, items } => {
            put_u32(out, *elem as u32);
            put_u64(out, items.len() as u64);
            items.iter().for_each(|item| put_value(out, item));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::file::GgufFile;
    use super::super::reader::{parse, tests::reason};
    use super::super::value::{ValueType, MAX_ARRAY_DEPTH};
    use super::*;

    fn every_value() -> Vec<(&'static str, Value)> {
        let arr = |elem, items| Value::Array { elem, items };
        let mut nested = arr(ValueType::I16, vec![Value::I16(-3)]);
        for _ in 1..MAX_ARRAY_DEPTH {
            nested = arr(
                ValueType::Array,
                vec![nested.clone(), arr(ValueType::I16, vec![])],
            );
        }
        vec![
            ("u8", Value::U8(200)),
            ("i8", Value::I8(-100)),
            ("u16", Value::U16(60_000)),
            ("i16", Value::I16(-30_000)),
            ("u32", Value::U32(4_000_000_000)),
            ("i32", Value::I32(-2_000_000_000)),
            ("u64", Value::U64(u64::MAX)),
            ("i64", Value::I64(i64::MIN)),
            ("f32", Value::F32(-1.5e-7)),
            ("f64", Value::F64(std::f64::consts::PI)),
            ("bool.t", Value::Bool(true)),
            ("bool.f", Value::Bool(false)),
            ("str", Value::from("héllo ✓")),
            ("str.empty", Value::from("")),
            (
                "arr.str",
                arr(ValueType::String, vec!["a".into(), "".into(), "ü".into()]),
            ),
            ("arr.f32", arr(ValueType::F32, vec![Value::F32(0.25); 3])),
            (
                "arr.bool",
                arr(ValueType::Bool, vec![Value::Bool(true), Value::Bool(false)]),
            ),
            ("arr.empty.str", arr(ValueType::String, vec![])),
            ("arr.empty.arr", arr(ValueType::Array, vec![])),
            ("arr.nested", nested),
        ]
    }

    fn tiny_model() -> GgufWriter {
        let mut w = GgufWriter::new();
        for (k, v) in every_value() {
            w.set(k, v).expect("valid value");
        }
        w.add_tensor("a", GgmlType::F32, &[3], vec![1; 12])
            .expect("f32 [3]");
        w.add_tensor("b", GgmlType::Q4_1, &[64, 2], vec![2; 80])
            .expect("q4_1 [64, 2]");
        w.add_tensor("c", GgmlType::Q6_K, &[256, 1, 1, 1], vec![3; 210])
            .expect("q6_K");
        w
    }

    #[test]
    fn every_value_type_and_tensor_round_trips() {
        let w = tiny_model();
        let bytes = w.to_bytes();
        let meta = parse(&bytes).expect("writer output parses");
        assert_eq!(meta.version(), 3);
        assert_eq!(
            meta.metadata(),
            every_value()
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v))
                .collect::<Vec<_>>()
        );
        assert_eq!(meta.data_offset() % 32, 0);
        for (t, want) in meta.tensors().iter().zip(&w.tensors) {
            assert_eq!((&t.name, t.ty, &t.dims), (&want.name, want.ty, &want.dims));
            assert_eq!(t.offset % 32, 0);
            let start = (meta.data_offset() + t.offset) as usize;
            assert_eq!(&bytes[start..start + t.n_bytes as usize], &want.data[..]);
        }
        // Re-writing what was read gives the same bytes.
        let mut again = GgufWriter::from_meta(&meta);
        for t in &w.tensors {
            again
                .add_tensor(t.name.clone(), t.ty, &t.dims, t.data.clone())
                .expect("same tensor");
        }
        assert_eq!(again.to_bytes(), bytes);
    }

    #[test]
    fn version_2_is_read_and_version_1_is_not() {
        let mut bytes = tiny_model().to_bytes();
        bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
        assert_eq!(parse(&bytes).map(|m| m.version()).ok(), Some(2));
        bytes[4..8].copy_from_slice(&1u32.to_le_bytes());
        assert!(reason(&bytes).contains("version 1 is not supported"));
    }

    #[test]
    fn custom_alignment_pads_tensors() {
        let mut w = tiny_model();
        w.set(ALIGNMENT_KEY, Value::U32(256)).expect("power of two");
        let meta = parse(&w.to_bytes()).expect("parses");
        assert_eq!(meta.alignment(), 256);
        assert_eq!(meta.data_offset() % 256, 0);
        assert!(meta.tensors().iter().all(|t| t.offset % 256 == 0));
    }

    #[test]
    fn set_replaces_in_place_and_refuses_unwritable_values() {
        let mut w = GgufWriter::new();
        w.set("a", 1u32.into())
            .and(w.set("b", 2u32.into()))
            .and(w.set("a", "x".into()))
            .expect("valid");
        assert_eq!(
            w.metadata,
            vec![("a".into(), "x".into()), ("b".into(), 2u32.into())]
        );
        assert_eq!(w.remove("a"), Some("x".into()));

        let refused = |w: &mut GgufWriter, key: &str, v: Value| match w.set(key, v) {
            Err(Error::Metadata { reason, .. }) => reason,
            other => panic!("expected Metadata error, got {other:?}"),
        };
        assert!(refused(&mut w, ALIGNMENT_KEY, Value::U32(48)).contains("power of two"));
        assert!(refused(&mut w, ALIGNMENT_KEY, Value::U64(64)).contains("power of two"));
        assert!(refused(&mut w, "", Value::U8(0)).contains("empty"));
        let mixed = Value::Array {
            elem: ValueType::U8,
            items: vec![Value::U16(1)],
        };
        assert!(refused(&mut w, "k", mixed).contains("holds a u16"));
    }

    #[test]
    fn add_tensor_checks_shape_and_size() {
        let mut w = GgufWriter::new();
        let refused = |w: &mut GgufWriter, ty, dims: &[u64], len| match w.add_tensor(
            "t",
            ty,
            dims,
            vec![0; len],
        ) {
            Err(Error::Tensor { reason, .. }) => reason,
            other => panic!("expected Tensor error, got {other:?}"),
        };
        assert!(
            refused(&mut w, GgmlType::F32, &[4], 15).contains("data is 15 bytes, f32 [4] needs 16")
        );
        assert!(refused(&mut w, GgmlType::Q8_0, &[16], 17)
            .contains("not a multiple of the q8_0 block size"));
        assert!(refused(&mut w, GgmlType::F32, &[0], 0).contains("dimension 0 is 0"));
        w.add_tensor("t", GgmlType::F32, &[1], vec![0; 4])
            .expect("valid");
        assert!(refused(&mut w, GgmlType::F32, &[1], 4).contains("duplicate"));
    }

    #[test]
    fn write_to_and_open_agree_with_to_bytes() {
        let w = tiny_model();
        let path = std::env::temp_dir().join(format!("gguf-writer-{}.gguf", std::process::id()));
        w.write_to(&path).expect("write temp file");
        let file = GgufFile::open(&path).expect("open written file");
        assert_eq!(file.bytes(), &w.to_bytes()[..]);
        let b = file.tensor("b").expect("tensor b");
        assert_eq!(file.tensor_bytes(b), &[2; 80][..]);
        assert_eq!(file.get_str("str"), Some("héllo ✓"));
        std::fs::remove_file(&path).ok();
    }

    #[test]
    fn tensors_added_for_later_are_filled_at_write_time() {
        let mut w = tiny_model();
        w.add_tensor_later("d", GgmlType::Q8_0, &[64, 3]).expect("q8_0 [64, 3]");
        assert!(w.add_tensor_later("a", GgmlType::F32, &[3]).is_err(), "duplicate");
        assert!(w.add_tensor_later("e", GgmlType::Q8_0, &[33]).is_err(), "not a whole block");
        let path = std::env::temp_dir().join(format!("gguf-writer-later-{}.gguf", std::process::id()));
        let mut asked = Vec::new();
        w.write_streaming(&path, |name, ty, dims, buf| {
            asked.push((name.to_owned(), ty, dims.to_vec(), buf.len()));
            buf.fill(7);
        })
        .expect("write");
        assert_eq!(asked, vec![("d".to_owned(), GgmlType::Q8_0, vec![64, 3], 204)]);
        let file = GgufFile::open(&path).expect("open written file");
        assert_eq!(file.tensor_bytes(file.tensor("d").unwrap()), &[7; 204][..]);
        assert_eq!(file.tensor_bytes(file.tensor("b").unwrap()), &[2; 80][..]);
        assert_eq!(file.bytes().len(), w.to_bytes().len());
        std::fs::remove_file(&path).ok();
    }
}
