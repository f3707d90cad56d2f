//! GGUF parsing. `parse` validates everything a later zero-copy access relies on
//! (every tensor's byte range lies inside the file, sizes do not overflow), so
//! `GgufFile::tensor_bytes` can hand out slices of the mapping without checks that
//! could fail.

use std::collections::HashMap;
use std::fmt;

use super::tensor_type::GgmlType;
use super::value::{Value, ValueType, MAX_ARRAY_DEPTH};
use crate::{Error, Result};

pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
pub const DEFAULT_ALIGNMENT: u64 = 32;
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// ggml tensors have at most four dimensions (GGML_MAX_DIMS).
pub const MAX_DIMS: usize = 4;

/// magic, version, tensor count, metadata count.
const HEADER_LEN: u64 = 4 + 4 + 8 + 8;
/// Smallest tensor info: name length (an empty name), dimension count, one
/// dimension, type, offset. Bounds the tensor count by the bytes left.
const MIN_TENSOR_INFO_LEN: u64 = 8 + 4 + 8 + 4 + 8;
/// Smallest metadata entry: key length, a one-byte key, value type, a one-byte value.
const MIN_KV_LEN: u64 = 8 + 1 + 4 + 1;
/// Counts are already bounded by the file size, but reserving for a hostile count up
/// front would still cost many times the file size before one entry has parsed; past
/// this many, vectors grow only as entries actually parse.
const MAX_PREALLOC: u64 = 1 << 16;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml `ne` order (innermost first), 1 to 4 dimensions, each at least 1.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Relative to the start of the data section (`GgufMeta::data_offset`).
    pub offset: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Cannot overflow: parse checked the product fits an i64.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// Everything in a GGUF file except the tensor data.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufMeta {
    version: u32,
    metadata: Vec<(String, Value)>,
    keys: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    names: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl GgufMeta {
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Metadata in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.keys
            .get(key)
            .and_then(|&i| self.metadata.get(i))
            .map(|(_, v)| v)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key)?.as_str()
    }

    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key)?.as_u64()
    }

    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get(key)?.as_f32()
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.names.get(name).and_then(|&i| self.tensors.get(i))
    }

    /// `general.alignment`, or 32 when the file does not set it.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset of the tensor data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// This metadata with `tensors` instead of its own: a split set's first part with the
    /// tensors of every part. An error names a tensor that two parts both hold.
    pub(super) fn with_tensors(mut self, tensors: Vec<TensorInfo>) -> std::result::Result<GgufMeta, String> {
        let mut names = HashMap::with_capacity(tensors.len());
        for (i, t) in tensors.iter().enumerate() {
            if names.insert(t.name.clone(), i).is_some() {
                return Err(format!("tensor `{}` is in two parts", Shown(&t.name)));
            }
        }
        self.tensors = tensors;
        self.names = names;
        Ok(self)
    }
}

fn invalid(offset: usize, reason: String) -> Error {
    Error::InvalidGguf {
        offset: offset as u64,
        reason,
    }
}

fn prealloc(count: u64) -> usize {
    usize::try_from(count.min(MAX_PREALLOC)).unwrap_or(0)
}

/// A key or tensor name from the file as error messages show it: escaped, because a
/// hostile file can put control characters in it, and cut short, because it can be
/// megabytes long.
#[derive(Clone, Copy)]
struct Shown<'a>(&'a str);

impl fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const MAX_SHOWN_CHARS: usize = 80;
        let mut chars = self.0.chars();
        for c in chars.by_ref().take(MAX_SHOWN_CHARS) {
            write!(f, "{}", c.escape_debug())?;
        }
        if chars.next().is_some() {
            f.write_str("…")?;
        }
        Ok(())
    }
}

/// Reads little-endian fields; every read checks the bytes are there. `what` names
/// the field for the error and is only formatted when a read fails.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        self.buf.len().saturating_sub(self.pos) as u64
    }

    fn take(&mut self, n: u64, what: fmt::Arguments<'_>) -> Result<&'a [u8]> {
        let end = usize::try_from(n)
            .ok()
            .and_then(|n| self.pos.checked_add(n));
        match end.and_then(|end| self.buf.get(self.pos..end)) {
            Some(bytes) => {
                self.pos += bytes.len();
                Ok(bytes)
            }
            None => Err(invalid(
                self.pos,
                format!(
                    "{what}: needs {n} bytes but the file ends {} bytes later",
                    self.remaining()
                ),
            )),
        }
    }

    fn array<const N: usize>(&mut self, what: fmt::Arguments<'_>) -> Result<[u8; N]> {
        let at = self.pos;
        let bytes = self.take(N as u64, what)?;
        <[u8; N]>::try_from(bytes).map_err(|_| invalid(at, format!("{what}: short read")))
    }

    fn u32(&mut self, what: fmt::Arguments<'_>) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: fmt::Arguments<'_>) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: fmt::Arguments<'_>) -> Result<&'a str> {
        let at = self.pos;
        let len = self.u64(format_args!("length of {what}"))?;
        if len > self.remaining() {
            let left = self.remaining();
            return Err(invalid(
                at,
                format!("{what}: string length {len} past end of file ({left} bytes left)"),
            ));
        }
        let bytes = self.take(len, what)?;
        std::str::from_utf8(bytes).map_err(|e| {
            let bad = e.valid_up_to();
            invalid(
                at + 8 + bad,
                format!("{what} is not valid UTF-8 (bad byte at index {bad})"),
            )
        })
    }
}

/// Parses and validates a GGUF header; `bytes` is the whole file (the tensor data is
/// only range-checked, never read).
pub fn parse(bytes: &[u8]) -> Result<GgufMeta> {
    let file_len = bytes.len() as u64;
    if file_len < HEADER_LEN {
        return Err(invalid(
            0,
            format!("file is {file_len} bytes, too short for the {HEADER_LEN}-byte GGUF header"),
        ));
    }
    let mut c = Cursor { buf: bytes, pos: 0 };

    let magic: [u8; 4] = c.array(format_args!("magic"))?;
    if magic != GGUF_MAGIC {
        let hex = u32::from_be_bytes(magic);
        return Err(invalid(
            0,
            format!(
                "bad magic 0x{hex:08x} ({:?}), expected \"GGUF\"",
                magic.escape_ascii().to_string()
            ),
        ));
    }
    let version = c.u32(format_args!("version"))?;
    match version {
        2 | 3 => {}
        1 => {
            return Err(invalid(
                4,
                "GGUF version 1 is not supported (only versions 2 and 3)".into(),
            ))
        }
        // A v2/v3 file written on a big-endian machine reads as 0x0?000000 here.
        v if v > 0xFFFF && v & 0xFFFF == 0 => {
            return Err(invalid(
                4,
                format!(
                    "GGUF version {v:#x} looks byte-swapped: big-endian files are not supported"
                ),
            ))
        }
        v => {
            return Err(invalid(
                4,
                format!("unsupported GGUF version {v} (only versions 2 and 3)"),
            ))
        }
    }

    let n_tensors = c.u64(format_args!("tensor count"))?;
    let n_kv = c.u64(format_args!("metadata count"))?;
    let left = c.remaining();
    if n_tensors > left / MIN_TENSOR_INFO_LEN {
        return Err(invalid(
            8,
            format!("tensor count {n_tensors} exceeds what a {file_len}-byte file can hold"),
        ));
    }
    if n_kv > left / MIN_KV_LEN {
        return Err(invalid(
            16,
            format!("metadata count {n_kv} exceeds what a {file_len}-byte file can hold"),
        ));
    }

    let mut metadata = Vec::with_capacity(prealloc(n_kv));
    let mut keys = HashMap::with_capacity(prealloc(n_kv));
    let mut alignment = DEFAULT_ALIGNMENT;
    for i in 0..n_kv {
        let key_at = c.pos;
        let raw_key = c.string(format_args!("key of metadata entry {i}"))?;
        let key = Shown(raw_key);
        if raw_key.is_empty() {
            return Err(invalid(
                key_at,
                format!("metadata entry {i} has an empty key"),
            ));
        }
        let ty_at = c.pos;
        let ty_id = c.u32(format_args!("value type of key `{key}`"))?;
        let ty = ValueType::from_u32(ty_id).ok_or_else(|| {
            invalid(
                ty_at,
                format!("unknown metadata value type {ty_id} for key `{key}`"),
            )
        })?;
        let value = read_value(&mut c, ty, key, 0)?;
        if raw_key == ALIGNMENT_KEY {
            alignment = match value {
                Value::U32(a) if a.is_power_of_two() => a.into(),
                Value::U32(a) => {
                    return Err(invalid(
                        key_at,
                        format!("{ALIGNMENT_KEY} {a} is not a power of two"),
                    ))
                }
                ref v => {
                    let ty = v.type_name();
                    return Err(invalid(
                        key_at,
                        format!("{ALIGNMENT_KEY} has type {ty}, expected u32"),
                    ));
                }
            };
        }
        if keys.insert(raw_key.to_owned(), metadata.len()).is_some() {
            return Err(invalid(key_at, format!("duplicate metadata key `{key}`")));
        }
        metadata.push((raw_key.to_owned(), value));
    }

    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(prealloc(n_tensors));
    let mut names = HashMap::with_capacity(prealloc(n_tensors));
    let mut info_at = Vec::with_capacity(prealloc(n_tensors));
    for i in 0..n_tensors {
        let at = c.pos;
        let raw_name = c.string(format_args!("name of tensor {i}"))?;
        let name = Shown(raw_name);
        let n_dims = c.u32(format_args!("dimension count of tensor `{name}`"))?;
        // Checked before reading so a huge count cannot drive the loop below.
        if n_dims == 0 || n_dims as usize > MAX_DIMS {
            return Err(invalid(
                at,
                format!("tensor `{name}` has {n_dims} dimensions (expected 1 to {MAX_DIMS})"),
            ));
        }
        let mut dims = Vec::with_capacity(MAX_DIMS);
        for d in 0..n_dims {
            dims.push(c.u64(format_args!("dimension {d} of tensor `{name}`"))?);
        }
        let ty_at = c.pos;
        let ty_id = c.u32(format_args!("type of tensor `{name}`"))?;
        let ty = GgmlType::from_u32(ty_id).ok_or_else(|| {
            invalid(
                ty_at,
                format!("unknown ggml type {ty_id} for tensor `{name}`"),
            )
        })?;
        let n_bytes = ty
            .tensor_bytes(&dims)
            .map_err(|why| invalid(at, format!("tensor `{name}` {why}")))?;
        let offset_at = c.pos;
        let offset = c.u64(format_args!("offset of tensor `{name}`"))?;
        if offset % alignment != 0 {
            return Err(invalid(
                offset_at,
                format!("tensor `{name}` offset {offset} is not aligned to {alignment}"),
            ));
        }
        if names.insert(raw_name.to_owned(), tensors.len()).is_some() {
            return Err(invalid(at, format!("duplicate tensor name `{name}`")));
        }
        tensors.push(TensorInfo {
            name: raw_name.to_owned(),
            dims,
            ty,
            offset,
            n_bytes,
        });
        info_at.push(at);
    }

    let header_end = c.pos as u64;
    let data_offset = header_end
        .checked_add(alignment - 1)
        .map(|end| end & !(alignment - 1))
        .ok_or_else(|| {
            invalid(
                c.pos,
                format!("data section start overflows aligning {header_end} to {alignment}"),
            )
        })?;
    for (t, &at) in tensors.iter().zip(&info_at) {
        let name = Shown(&t.name);
        let start = data_offset.checked_add(t.offset);
        let Some((start, end)) = start.zip(start.and_then(|s| s.checked_add(t.n_bytes))) else {
            return Err(invalid(
                at,
                format!("tensor `{name}` data offset {} overflows", t.offset),
            ));
        };
        if end > file_len {
            return Err(invalid(
                at,
                format!("tensor `{name}` data [{start}, {end}) past end of file (len {file_len})"),
            ));
        }
    }

    Ok(GgufMeta {
        version,
        metadata,
        keys,
        tensors,
        names,
        alignment,
        data_offset,
    })
}

/// `depth` is how many arrays enclose this value.
fn read_value(c: &mut Cursor<'_>, ty: ValueType, key: Shown<'_>, depth: usize) -> Result<Value> {
    let at = c.pos;
    let what = format_args!("value of key `{key}`");
    Ok(match ty {
        ValueType::U8 => Value::U8(u8::from_le_bytes(c.array(what)?)),
        ValueType::I8 => Value::I8(i8::from_le_bytes(c.array(what)?)),
        ValueType::U16 => Value::U16(u16::from_le_bytes(c.array(what)?)),
        ValueType::I16 => Value::I16(i16::from_le_bytes(c.array(what)?)),
        ValueType::U32 => Value::U32(u32::from_le_bytes(c.array(what)?)),
        ValueType::I32 => Value::I32(i32::from_le_bytes(c.array(what)?)),
        ValueType::U64 => Value::U64(u64::from_le_bytes(c.array(what)?)),
        ValueType::I64 => Value::I64(i64::from_le_bytes(c.array(what)?)),
        ValueType::F32 => Value::F32(f32::from_le_bytes(c.array(what)?)),
        ValueType::F64 => Value::F64(f64::from_le_bytes(c.array(what)?)),
        // The spec calls anything but 0 or 1 invalid; accepting it would not round-trip.
        ValueType::Bool => match c.array::<1>(what)? {
            [0] => Value::Bool(false),
            [1] => Value::Bool(true),
            [b] => {
                return Err(invalid(
                    at,
                    format!("bool value {b} for key `{key}` (expected 0 or 1)"),
                ))
            }
        },
        ValueType::String => Value::String(
            c.string(format_args!("string value of key `{key}`"))?
                .to_owned(),
        ),
        ValueType::Array => {
            if depth >= MAX_ARRAY_DEPTH {
                return Err(invalid(
                    at,
                    format!("key `{key}` has arrays nested deeper than {MAX_ARRAY_DEPTH} levels"),
                ));
            }
            let elem_id = c.u32(format_args!("array type of key `{key}`"))?;
            let elem = ValueType::from_u32(elem_id).ok_or_else(|| {
                invalid(
                    at,
                    format!("unknown metadata value type {elem_id} in array for key `{key}`"),
                )
            })?;
            let count = c.u64(format_args!("array length of key `{key}`"))?;
            let left = c.remaining();
            if count > left / elem.min_encoded_size() {
                return Err(invalid(at, format!("array of {count} {elem} for key `{key}` past end of file ({left} bytes left)")));
            }
            let mut items = Vec::with_capacity(prealloc(count));
            for _ in 0..count {
                items.push(read_value(c, elem, key, depth + 1)?);
            }
            Value::Array { elem, items }
        }
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Hand-assembled GGUF bytes, for files the writer refuses to produce.
    pub(crate) struct Raw(pub Vec<u8>);

    impl Raw {
        pub fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
            Raw(b"GGUF".to_vec()).u32(version).u64(n_tensors).u64(n_kv)
        }
        pub fn u32(mut self, v: u32) -> Raw {
            self.0.extend_from_slice(&v.to_le_bytes());
            self
        }
        pub fn u64(mut self, v: u64) -> Raw {
            self.0.extend_from_slice(&v.to_le_bytes());
            self
        }
        pub fn bytes(mut self, b: &[u8]) -> Raw {
            self.0.extend_from_slice(b);
            self
        }
        pub fn str(self, s: &[u8]) -> Raw {
            self.u64(s.len() as u64).bytes(s)
        }
        pub fn kv_u32(self, key: &str, v: u32) -> Raw {
            self.str(key.as_bytes()).u32(ValueType::U32 as u32).u32(v)
        }
        pub fn tensor(self, name: &str, dims: &[u64], ty: u32, offset: u64) -> Raw {
            let raw = self.str(name.as_bytes()).u32(dims.len() as u32);
            dims.iter().fold(raw, |r, &d| r.u64(d)).u32(ty).u64(offset)
        }
        /// Pads to the data section and appends `n` data bytes.
        pub fn data(mut self, n: usize) -> Raw {
            let padded = self.0.len().div_ceil(32) * 32;
            self.0.resize(padded + n, 0);
            self
        }
    }

    /// The reason of the InvalidGguf error parsing `raw` must give.
    pub(crate) fn reason(raw: &[u8]) -> String {
        match parse(raw) {
            Err(Error::InvalidGguf { reason, .. }) => reason,
            other => panic!("expected InvalidGguf, got {other:?}"),
        }
    }

    fn one_f32_tensor() -> Raw {
        Raw::header(3, 1, 0).tensor("t", &[4], 0, 0)
    }

    #[test]
    fn minimal_file_parses() {
        let meta = parse(&one_f32_tensor().data(16).0).expect("valid file");
        assert_eq!(meta.version(), 3);
        assert_eq!(meta.data_offset(), 64);
        let t = meta.tensor("t").expect("tensor t");
        assert_eq!((t.ty, t.n_bytes, t.n_elements()), (GgmlType::F32, 16, 4));
    }

    #[test]
    fn header_errors() {
        assert!(reason(b"GGUF").contains("too short"));
        assert!(
            reason(&Raw(b"GGML".to_vec()).u32(3).u64(0).u64(0).0).contains("bad magic 0x47474d4c")
        );
        assert!(reason(&Raw::header(1, 0, 0).0).contains("version 1 is not supported"));
        assert!(reason(&Raw::header(4, 0, 0).0).contains("unsupported GGUF version 4"));
        assert!(reason(&Raw::header(0x0300_0000, 0, 0).0).contains("byte-swapped"));
        let r = reason(&Raw::header(3, 1 << 40, 0).0);
        assert!(
            r.contains("tensor count 1099511627776 exceeds what a 24-byte file can hold"),
            "{r}"
        );
        assert!(reason(&Raw::header(3, 0, u64::MAX).0).contains("metadata count"));
    }

    #[test]
    fn metadata_errors() {
        let kv = |key: &[u8], ty: u32, value: &[u8]| {
            Raw::header(3, 0, 1).str(key).u32(ty).bytes(value).0
        };
        assert!(reason(&kv(b"k", 13, &[0])).contains("unknown metadata value type 13 for key `k`"));
        assert!(reason(&kv(b"k", 7, &[2])).contains("bool value 2"));
        assert!(
            reason(&kv(b"\xff", 0, &[0])).contains("key of metadata entry 0 is not valid UTF-8")
        );
        let empty_key = Raw::header(3, 0, 1).str(b"").u32(0).bytes(&[0; 8]).0;
        assert!(reason(&empty_key).contains("empty key"));
        let r = reason(&kv(b"k", 8, &u64::MAX.to_le_bytes()));
        assert!(
            r.contains("string value of key `k`: string length 18446744073709551615 past end"),
            "{r}"
        );
        let bad_str = [&2u64.to_le_bytes()[..], b"\xc3("].concat();
        assert!(
            reason(&kv(b"k", 8, &bad_str)).contains("string value of key `k` is not valid UTF-8")
        );
        let huge_array = [&0u32.to_le_bytes()[..], &(1u64 << 50).to_le_bytes()].concat();
        assert!(reason(&kv(b"k", 9, &huge_array))
            .contains("array of 1125899906842624 u8 for key `k` past end"));
        let unknown_elem = [&77u32.to_le_bytes()[..], &0u64.to_le_bytes()].concat();
        assert!(
            reason(&kv(b"k", 9, &unknown_elem)).contains("unknown metadata value type 77 in array")
        );
        assert!(reason(&kv(b"k", 4, &[1, 2])).contains("value of key `k`: needs 4 bytes"));

        // Nine nested arrays, the innermost empty.
        let mut deep = Vec::new();
        for _ in 0..MAX_ARRAY_DEPTH + 1 {
            deep.extend_from_slice(&(ValueType::Array as u32).to_le_bytes());
            deep.extend_from_slice(&1u64.to_le_bytes());
        }
        deep.extend_from_slice(&[0; 12]);
        assert!(reason(&kv(b"k", 9, &deep)).contains("nested deeper than 8"));

        let r = reason(&kv(b"a\nb", 13, &[0]));
        assert!(
            r.contains("for key `a\\nb`"),
            "control characters must be escaped: {r}"
        );
        let r = reason(&kv(&[b'x'; 1000], 13, &[0]));
        assert!(
            r.contains(&format!("`{}…`", "x".repeat(80))) && r.len() < 200,
            "long keys must be cut: {r}"
        );

        let dup = Raw::header(3, 0, 2).kv_u32("k", 1).kv_u32("k", 2).0;
        assert!(reason(&dup).contains("duplicate metadata key `k`"));
    }

    #[test]
    fn alignment_errors() {
        let align = |v: u32| Raw::header(3, 0, 1).kv_u32(ALIGNMENT_KEY, v).0;
        assert!(reason(&align(0)).contains("general.alignment 0 is not a power of two"));
        assert!(reason(&align(48)).contains("general.alignment 48 is not a power of two"));
        assert_eq!(parse(&align(64)).map(|m| m.alignment()).ok(), Some(64));
        let as_u64 = Raw::header(3, 0, 1)
            .str(ALIGNMENT_KEY.as_bytes())
            .u32(10)
            .u64(32)
            .0;
        assert!(reason(&as_u64).contains("has type u64, expected u32"));
    }

    #[test]
    fn tensor_errors() {
        let one = |dims: &[u64], ty: u32, offset: u64| {
            Raw::header(3, 1, 0)
                .tensor("x", dims, ty, offset)
                .data(64)
                .0
        };
        assert!(reason(&one(&[4], 99, 0)).contains("unknown ggml type 99 for tensor `x`"));
        assert!(reason(&one(&[4, 0], 0, 0)).contains("tensor `x` dimension 1 is 0"));
        assert!(reason(&one(&[], 0, 0)).contains("tensor `x` has 0 dimensions"));
        assert!(reason(&one(&[1; 5], 0, 0)).contains("tensor `x` has 5 dimensions"));
        assert!(reason(&one(&[1 << 32, 1 << 32], 0, 0)).contains("element count"));
        assert!(reason(&one(&[48], 2, 0))
            .contains("row length 48 is not a multiple of the q4_0 block size 32"));
        assert!(reason(&one(&[4], 0, 8)).contains("tensor `x` offset 8 is not aligned to 32"));
        let r = reason(&one(&[4], 0, 64));
        assert!(
            r.contains("tensor `x` data [128, 144) past end of file (len 128)"),
            "{r}"
        );
        assert!(reason(&one(&[4], 0, u64::MAX - 31)).contains("overflows"));
        let huge_dims = Raw::header(3, 1, 0)
            .str(b"x")
            .u32(u32::MAX)
            .bytes(&[0; 64])
            .0;
        assert!(reason(&huge_dims).contains("4294967295 dimensions"));

        let dup = Raw::header(3, 2, 0)
            .tensor("x", &[4], 0, 0)
            .tensor("x", &[4], 0, 32)
            .data(64)
            .0;
        assert!(reason(&dup).contains("duplicate tensor name `x`"));
    }

    #[test]
    fn every_truncation_of_a_valid_file_is_an_error() {
        let file = Raw::header(3, 1, 1)
            .kv_u32("a", 1)
            .tensor("t", &[8], 0, 0)
            .data(32)
            .0;
        assert!(parse(&file).is_ok());
        for len in 0..file.len() {
            assert!(parse(&file[..len]).is_err(), "prefix of {len} bytes parsed");
        }
    }
}
