//! The engine's one error type. Every failure a caller can cause (a bad file, a bad
//! batch, a full cache) is a variant here with a message that names what is wrong.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The file is not a GGUF file hearth can read: wrong magic, truncated, absurd
    /// counts or sizes, offsets past the end, unknown value or tensor types.
    #[error("invalid GGUF at byte {offset}: {reason}")]
    InvalidGguf { offset: u64, reason: String },

    #[error("model architecture `{0}` is not supported (hearth runs llama, mistral3, qwen2, qwen3, qwen3moe, gemma3, gpt-oss, glm4moe)")]
    UnsupportedArchitecture(String),

    #[error("model metadata `{key}` is missing or has the wrong type: {reason}")]
    Metadata { key: String, reason: String },

    #[error("model tensor `{name}`: {reason}")]
    Tensor { name: String, reason: String },

    #[error("cannot make this model: {0}")]
    InvalidModel(String),

    #[error("invalid layer window: {0}")]
    InvalidWindow(String),

    /// A request the caller should have refused (an empty or over-long embedding input).
    #[error("invalid request: {0}")]
    InvalidRequest(String),

    #[error("invalid batch: {0}")]
    InvalidBatch(String),

    #[error("sequence {seq} is full: position {pos} does not fit its {capacity} context cells")]
    SequenceFull { seq: u64, pos: u32, capacity: u32 },

    #[error("KV cache is full: all {slots} sequence slots are in use")]
    CacheFull { slots: usize },

    #[error("unknown sequence {0}")]
    UnknownSequence(u64),

    #[error("ggml: {0}")]
    Ggml(String),

    #[error("llama.cpp: {0}")]
    Llama(String),

    #[error("chat template: {0}")]
    ChatTemplate(String),

    /// A render of the chat template passed one of its bounds (work, output, memory, time;
    /// `chat_template::Bounds`): the template, these inputs, or both are hostile or absurd.
    #[error("chat template: {0}")]
    TemplateLimit(String),

    #[error("sampler: {0}")]
    Sampler(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
