//! Embeddings: OpenAI's `POST /v1/embeddings`, Ollama's `POST /api/embed` and its older
//! `POST /api/embeddings`, answered by the embedding model (`--embedding-model`). Inputs
//! are tokenized off the HTTP threads, checked (non-empty, in the vocabulary, within the
//! model's context: OpenAI's route refuses a longer input, Ollama's cuts it unless told
//! not to), queued to the embedding thread, and the vectors normalised to unit length
//! (all but Ollama's older route, which answers them as the model pools them).

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::Json;
use base64::Engine as _;
use openapi::{
    check_dimensions, Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage, EmbeddingVector, OllamaEmbedRequest, OllamaEmbedResponse, OllamaEmbeddingsRequest, OllamaEmbeddingsResponse,
    OneInput,
};

use super::error::ApiError;
use super::json::ApiJson;
use super::{prepare, AppState, Embeddings};
use crate::runtime::embeddings::EmbedError;

/// What to do with an input longer than the model's context.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Overflow {
    Refuse,
    Truncate,
}

fn served(state: &AppState) -> Result<Arc<Embeddings>, ApiError> {
    state.embeddings.clone().ok_or_else(|| ApiError::InvalidParameter {
        param: Some("model".into()),
        message: "this server has no embedding model: start hearth serve with --embedding-model PATH (a GGUF embedding model such as nomic-embed-text, bge or Qwen3-Embedding)".into(),
    })
}

/// The embedding model's id, or an empty name for it; Ollama's clients may add `:latest`.
fn check_name(e: &Embeddings, name: &str, ollama: bool) -> Result<(), ApiError> {
    let bare = if ollama { name.strip_suffix(":latest").unwrap_or(name) } else { name };
    if bare.is_empty() || bare == e.service.model.id {
        Ok(())
    } else {
        Err(ApiError::ModelNotFound(name.to_string()))
    }
}

impl From<EmbedError> for ApiError {
    fn from(e: EmbedError) -> Self {
        match e {
            EmbedError::QueueFull => ApiError::QueueFull,
            EmbedError::Stopped => ApiError::ShuttingDown,
            EmbedError::Engine(m) => ApiError::Internal(format!("embedding: {m}")),
        }
    }
}

/// Token lists of the inputs, checked, and their token count.
async fn tokens_of(e: &Arc<Embeddings>, inputs: Vec<OwnedInput>, overflow: Overflow) -> Result<Vec<Vec<i32>>, ApiError> {
    let e = e.clone();
    prepare::run(move || {
        let m = &e.service.model;
        let n_vocab = m.tokenizer.n_vocab() as i64;
        inputs
            .into_iter()
            .enumerate()
            .map(|(i, input)| {
                let mut tokens = match input {
                    OwnedInput::Text(t) => m.tokenizer.tokenize_with(&t, true, true),
                    OwnedInput::Tokens(ids) => match ids.iter().find(|&&t| t < 0 || t >= n_vocab) {
                        Some(bad) => return Err(ApiError::InvalidParameter { param: Some(format!("input[{i}]")), message: format!("input[{i}] holds token {bad}, outside the embedding model's vocabulary of {n_vocab} tokens") }),
                        None => ids.into_iter().map(|t| t as i32).collect(),
                    },
                };
                if tokens.is_empty() {
                    return Err(ApiError::InvalidParameter { param: Some(format!("input[{i}]")), message: format!("input[{i}] has no tokens") });
                }
                if tokens.len() > m.n_ctx {
                    if overflow == Overflow::Refuse {
                        return Err(ApiError::ContextLengthExceeded { max: m.n_ctx, limit: m.n_ctx, prompt: tokens.len(), field: "input" });
                    }
                    // Keep the last token: the separator or end-of-text token the model
                    // pools on (BERT's [SEP], a last-token embedder's EOS).
                    let last = tokens[tokens.len() - 1];
                    tokens.truncate(m.n_ctx - 1);
                    tokens.push(last);
                }
                Ok(tokens)
            })
            .collect()
    })
    .await
}

enum OwnedInput {
    Text(String),
    Tokens(Vec<i64>),
}

fn owned(inputs: Vec<OneInput>) -> Vec<OwnedInput> {
    inputs
        .into_iter()
        .map(|i| match i {
            OneInput::Text(t) => OwnedInput::Text(t.to_string()),
            OneInput::Tokens(t) => OwnedInput::Tokens(t.to_vec()),
        })
        .collect()
}

/// Unit-length vectors of `dims` values (all when `None`): cut, then normalised, as a
/// Matryoshka-trained model's shorter embedding is.
fn finish(mut vectors: Vec<Vec<f32>>, dims: Option<usize>) -> Vec<Vec<f32>> {
    for v in &mut vectors {
        if let Some(d) = dims {
            v.truncate(d);
        }
        engine::embedder::normalize(v);
    }
    vectors
}

pub async fn openai(State(state): State<Arc<AppState>>, ApiJson(req): ApiJson<EmbeddingRequest>) -> Result<Json<EmbeddingResponse>, ApiError> {
    let e = served(&state)?;
    check_name(&e, &req.model, false)?;
    let base64 = req.base64()?;
    let dims = check_dimensions(req.dimensions, e.service.model.dims)?;
    let inputs = owned(req.input.inputs()?);
    let tokens = tokens_of(&e, inputs, Overflow::Refuse).await?;
    let prompt_tokens = tokens.iter().map(Vec::len).sum();
    let vectors = finish(e.service.embed(tokens).await?, dims);
    let data = vectors
        .into_iter()
        .enumerate()
        .map(|(index, v)| Embedding {
            object: "embedding".into(),
            index,
            embedding: if base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                EmbeddingVector::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                EmbeddingVector::Float(v)
            },
        })
        .collect();
    Ok(Json(EmbeddingResponse { object: "list".into(), data, model: e.service.model.id.clone(), usage: EmbeddingUsage { prompt_tokens, total_tokens: prompt_tokens } }))
}

pub async fn ollama_embed(State(state): State<Arc<AppState>>, ApiJson(req): ApiJson<OllamaEmbedRequest>) -> Result<Json<OllamaEmbedResponse>, ApiError> {
    let start = Instant::now();
    let e = served(&state)?;
    check_name(&e, &req.model, true)?;
    let dims = check_dimensions(req.dimensions, e.service.model.dims)?;
    let overflow = if req.truncate == Some(false) { Overflow::Refuse } else { Overflow::Truncate };
    let inputs = owned(req.input.inputs()?);
    let tokens = tokens_of(&e, inputs, overflow).await?;
    let prompt_eval_count = tokens.iter().map(Vec::len).sum();
    let embeddings = finish(e.service.embed(tokens).await?, dims);
    let model = if req.model.is_empty() { e.service.model.id.clone() } else { req.model };
    Ok(Json(OllamaEmbedResponse { model, embeddings, total_duration: start.elapsed().as_nanos() as u64, load_duration: 0, prompt_eval_count }))
}

pub async fn ollama_embeddings(State(state): State<Arc<AppState>>, ApiJson(req): ApiJson<OllamaEmbeddingsRequest>) -> Result<Json<OllamaEmbeddingsResponse>, ApiError> {
    let e = served(&state)?;
    check_name(&e, &req.model, true)?;
    // Ollama answers an empty prompt with an empty vector.
    if req.prompt.is_empty() {
        return Ok(Json(OllamaEmbeddingsResponse { embedding: Vec::new() }));
    }
    let tokens = tokens_of(&e, vec![OwnedInput::Text(req.prompt)], Overflow::Truncate).await?;
    let embedding = e.service.embed(tokens).await?.pop().unwrap_or_default();
    Ok(Json(OllamaEmbeddingsResponse { embedding }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shorter_vectors_are_normalised_again() {
        let v = finish(vec![vec![3.0, 4.0, 12.0]], Some(2));
        assert_eq!(v, vec![vec![0.6, 0.8]]);
        let whole = finish(vec![vec![3.0, 4.0, 12.0]], None);
        assert!((whole[0].iter().map(|x| x * x).sum::<f32>() - 1.0).abs() < 1e-6);
    }
}
