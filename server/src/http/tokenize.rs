//! `POST /tokenize` and `POST /detokenize` (llama-server's routes and fields): what the
//! served model's tokenizer makes of a text, and the text of tokens (control tokens written
//! out, as llama-server does, so the two round-trip). Ids outside the
//! vocabulary are the client's 400, never handed to llama.cpp.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use openapi::{DetokenizeRequest, DetokenizeResponse, TextOrToken, TokenOut, TokenPiece, TokenizeContent, TokenizeRequest, TokenizeResponse};

use super::error::ApiError;
use super::json::ApiJson;
use super::prepare;
use super::AppState;

fn check_id(state: &AppState, id: i64, param: &str) -> Result<i32, ApiError> {
    let n = state.tokenizer.n_vocab() as i64;
    if (0..n).contains(&id) {
        Ok(id as i32)
    } else {
        Err(ApiError::InvalidParameter { param: Some(param.into()), message: format!("{param}: token id {id} is outside the model's vocabulary of {n} tokens") })
    }
}

/// Tokens of `text` with or without the BOS the tokenizer adds to a prompt's start (the
/// model's own choice when `with_bos`: llama-server's `add_special`).
fn tokens_of(state: &AppState, text: &str, parse_special: bool, with_bos: bool) -> Vec<i32> {
    if with_bos {
        state.tokenizer.tokenize(text, parse_special)
    } else {
        state.tokenizer.tokenize_with(text, parse_special, false)
    }
}

pub async fn tokenize(State(state): State<Arc<AppState>>, ApiJson(req): ApiJson<TokenizeRequest>) -> Result<Json<TokenizeResponse>, ApiError> {
    // Tokenizing a body-limit-sized text takes a while: off the HTTP threads.
    prepare::run(move || {
        let mut ids = Vec::new();
        match &req.content {
            TokenizeContent::Text(t) => ids = tokens_of(&state, t, req.parse_special, req.add_special),
            TokenizeContent::Mixed(parts) => {
                for (i, p) in parts.iter().enumerate() {
                    match p {
                        TextOrToken::Token(id) => ids.push(check_id(&state, *id, &format!("content[{i}]"))?),
                        TextOrToken::Text(t) => ids.extend(tokens_of(&state, t, req.parse_special, req.add_special && i == 0)),
                    }
                }
            }
        }
        let tokens = ids
            .into_iter()
            .map(|id| {
                if !req.with_pieces {
                    return TokenOut::Id(id);
                }
                let bytes = state.tokenizer.token_bytes(id);
                let piece = match String::from_utf8(bytes) {
                    Ok(s) => TokenPiece::Text(s),
                    Err(e) => TokenPiece::Bytes(e.into_bytes()),
                };
                TokenOut::WithPiece { id, piece }
            })
            .collect();
        Ok(Json(TokenizeResponse { tokens }))
    })
    .await
}

pub async fn detokenize(State(state): State<Arc<AppState>>, ApiJson(req): ApiJson<DetokenizeRequest>) -> Result<Json<DetokenizeResponse>, ApiError> {
    prepare::run(move || {
        let ids = req.tokens.iter().enumerate().map(|(i, &id)| check_id(&state, id, &format!("tokens[{i}]"))).collect::<Result<Vec<_>, _>>()?;
        Ok(Json(DetokenizeResponse { content: state.tokenizer.detokenize_with(&ids, true) }))
    })
    .await
}
