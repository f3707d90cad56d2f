//! Embeddings: OpenAI's `POST /v1/embeddings` and Ollama's `POST /api/embed` and older
//! `POST /api/embeddings`, answered by the embedding model served beside the chat model.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::WireError;

/// Most inputs one request may carry (OpenAI's own limit).
pub const MAX_EMBEDDING_INPUTS: usize = 2048;

/// `POST /v1/embeddings`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct EmbeddingRequest {
    /// Text to embed: a string, a list of strings, a list of token ids, or a list of such
    /// lists. Each input must be non-empty and fit the embedding model's context.
    pub input: EmbeddingInput,
    /// The embedding model's id (as `/v1/models` lists it); empty for the served one.
    #[serde(default)]
    pub model: String,
    /// `float` (default) or `base64` (the little-endian f32 bytes of each vector).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(example = "float", pattern = "^(float|base64)$")]
    pub encoding_format: Option<String>,
    /// Keep the first `dimensions` values of each vector and normalise them again
    /// (meaningful for models trained for it: Qwen3-Embedding, nomic-embed-text v1.5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1)]
    pub dimensions: Option<i64>,
    /// Accepted and ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}

/// The inputs of an embedding request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum EmbeddingInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<i64>),
    TokenLists(Vec<Vec<i64>>),
}

/// One input, as text or token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OneInput<'a> {
    Text(&'a str),
    Tokens(&'a [i64]),
}

impl EmbeddingInput {
    /// Each input in order; an error for no inputs, too many, or an empty one.
    pub fn inputs(&self) -> Result<Vec<OneInput<'_>>, WireError> {
        let all: Vec<OneInput> = match self {
            EmbeddingInput::Text(t) => vec![OneInput::Text(t)],
            EmbeddingInput::Texts(ts) => ts.iter().map(|t| OneInput::Text(t)).collect(),
            EmbeddingInput::Tokens(ids) => vec![OneInput::Tokens(ids)],
            EmbeddingInput::TokenLists(lists) => lists.iter().map(|l| OneInput::Tokens(l)).collect(),
        };
        check_inputs(&all)?;
        Ok(all)
    }
}

fn check_inputs(all: &[OneInput]) -> Result<(), WireError> {
    if all.is_empty() {
        return Err(WireError::invalid("input", "input must hold at least one text or token list"));
    }
    if all.len() > MAX_EMBEDDING_INPUTS {
        return Err(WireError::invalid("input", format!("input holds {} items; at most {MAX_EMBEDDING_INPUTS} per request", all.len())));
    }
    if let Some(i) = all.iter().position(|x| match x {
        OneInput::Text(t) => t.is_empty(),
        OneInput::Tokens(ids) => ids.is_empty(),
    }) {
        return Err(WireError::invalid("input", format!("input[{i}] is empty; every input needs at least one character or token")));
    }
    Ok(())
}

impl EmbeddingRequest {
    /// Whether vectors go out base64-encoded; an error for a format OpenAI does not have.
    pub fn base64(&self) -> Result<bool, WireError> {
        match self.encoding_format.as_deref() {
            None | Some("float") => Ok(false),
            Some("base64") => Ok(true),
            Some(other) => Err(WireError::invalid("encoding_format", format!("encoding_format `{other}`: use `float` or `base64`"))),
        }
    }
}

/// `dimensions` checked against the model's vector length.
pub fn check_dimensions(dimensions: Option<i64>, model_dims: usize) -> Result<Option<usize>, WireError> {
    match dimensions {
        None => Ok(None),
        Some(d) if d >= 1 && d as u64 <= model_dims as u64 => Ok(Some(d as usize)),
        Some(d) => Err(WireError::invalid("dimensions", format!("dimensions {d}: the embedding model makes vectors of {model_dims} values; ask for 1 to {model_dims}"))),
    }
}

/// The answer of `POST /v1/embeddings`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct EmbeddingResponse {
    /// Always `list`.
    pub object: String,
    pub data: Vec<Embedding>,
    pub model: String,
    pub usage: EmbeddingUsage,
}

/// One input's embedding.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Embedding {
    /// Always `embedding`.
    pub object: String,
    /// The input's position in the request.
    pub index: usize,
    pub embedding: EmbeddingVector,
}

/// A vector as numbers, or as base64 of its little-endian f32 bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum EmbeddingVector {
    Float(Vec<f32>),
    Base64(String),
}

/// Tokens the inputs took.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct EmbeddingUsage {
    pub prompt_tokens: usize,
    pub total_tokens: usize,
}

/// `POST /api/embed` (Ollama).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OllamaEmbedRequest {
    /// The embedding model's name (`<id>` or `<id>:latest`).
    #[serde(default)]
    pub model: String,
    /// A text or a list of texts.
    pub input: OllamaEmbedInput,
    /// Cut inputs longer than the model's context to fit (default) instead of refusing
    /// them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub truncate: Option<bool>,
    /// Keep the first `dimensions` values of each vector and normalise them again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1)]
    pub dimensions: Option<i64>,
    /// Accepted and ignored (the model stays loaded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_alive: Option<serde_json::Value>,
    /// Accepted; only `num_ctx` is read (at most the embedding model's context).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub options: Option<serde_json::Value>,
}

/// Ollama's embed input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum OllamaEmbedInput {
    Text(String),
    Texts(Vec<String>),
}

impl OllamaEmbedInput {
    pub fn inputs(&self) -> Result<Vec<OneInput<'_>>, WireError> {
        let all: Vec<OneInput> = match self {
            OllamaEmbedInput::Text(t) => vec![OneInput::Text(t)],
            OllamaEmbedInput::Texts(ts) => ts.iter().map(|t| OneInput::Text(t)).collect(),
        };
        check_inputs(&all)?;
        Ok(all)
    }
}

/// The answer of `POST /api/embed`: normalised vectors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OllamaEmbedResponse {
    pub model: String,
    pub embeddings: Vec<Vec<f32>>,
    /// Nanoseconds the request took.
    pub total_duration: u64,
    pub load_duration: u64,
    pub prompt_eval_count: usize,
}

/// `POST /api/embeddings` (Ollama's older route).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OllamaEmbeddingsRequest {
    #[serde(default)]
    pub model: String,
    /// The text to embed.
    pub prompt: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_alive: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub options: Option<serde_json::Value>,
}

/// The answer of `POST /api/embeddings`: the vector as the model pools it, not normalised
/// (as Ollama's older route answers).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OllamaEmbeddingsResponse {
    pub embedding: Vec<f32>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn req(v: serde_json::Value) -> EmbeddingRequest {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn every_input_shape_parses() {
        assert_eq!(req(json!({"input": "a"})).input.inputs().unwrap(), vec![OneInput::Text("a")]);
        assert_eq!(req(json!({"input": ["a", "b"]})).input.inputs().unwrap().len(), 2);
        assert_eq!(req(json!({"input": [1, 2, 3]})).input.inputs().unwrap(), vec![OneInput::Tokens(&[1, 2, 3])]);
        assert_eq!(req(json!({"input": [[1], [2, 3]]})).input.inputs().unwrap().len(), 2);
    }

    #[test]
    fn empty_inputs_are_refused() {
        for bad in [json!({"input": ""}), json!({"input": []}), json!({"input": ["a", ""]}), json!({"input": [[1], []]})] {
            assert!(req(bad.clone()).input.inputs().is_err(), "{bad}");
        }
        let many: Vec<String> = (0..=MAX_EMBEDDING_INPUTS).map(|i| i.to_string()).collect();
        assert!(req(json!({"input": many})).input.inputs().is_err());
    }

    #[test]
    fn formats_and_dimensions() {
        assert!(!req(json!({"input": "a"})).base64().unwrap());
        assert!(req(json!({"input": "a", "encoding_format": "base64"})).base64().unwrap());
        assert!(req(json!({"input": "a", "encoding_format": "int8"})).base64().is_err());
        assert_eq!(check_dimensions(Some(8), 64).unwrap(), Some(8));
        assert!(check_dimensions(Some(0), 64).is_err());
        assert!(check_dimensions(Some(65), 64).is_err());
        assert!(check_dimensions(Some(-1), 64).is_err());
    }
}
