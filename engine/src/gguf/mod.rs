//! Zero-copy GGUF reading and writing, with no ggml dependency.
//!
//! [`GgufFile`] maps a model file (or every part of a split set, [`split`]) read-only,
//! parses and validates its header (metadata, tensor infos, every tensor's byte range)
//! and then hands out tensor data as slices of the mapping. [`parse`] is the same validation over any byte slice and
//! is written for hostile input: malformed files give `Error::InvalidGguf` naming the
//! byte and the problem, never a panic, an overflow, or an allocation larger than the
//! file could justify. [`GgufWriter`] builds GGUF v3 files, e.g. tiny test models that
//! carry a real model's tokenizer metadata.

pub mod faults;
mod file;
mod reader;
pub mod split;
mod tensor_type;
mod value;
mod writer;

pub use file::{GgufFile, Part};
pub use reader::{parse, GgufMeta, TensorInfo, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS};
pub use tensor_type::GgmlType;
pub use value::{Value, ValueType, MAX_ARRAY_DEPTH};
pub use writer::GgufWriter;
