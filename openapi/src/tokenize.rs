//! `POST /tokenize` and `POST /detokenize`, with llama-server's fields: the served model's
//! tokens of a text, and the text of tokens.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// `POST /tokenize`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TokenizeRequest {
    /// Text, or a list of text pieces and token ids (ids are kept as they are).
    pub content: TokenizeContent,
    /// Add the model's special tokens (BOS) as a prompt would have them.
    #[serde(default)]
    #[schema(default = false)]
    pub add_special: bool,
    /// Read control-token text (`<|im_start|>`) as those tokens.
    #[serde(default = "yes")]
    #[schema(default = true)]
    pub parse_special: bool,
    /// Answer each token with its text (`{"id", "piece"}`).
    #[serde(default)]
    #[schema(default = false)]
    pub with_pieces: bool,
}

fn yes() -> bool {
    true
}

/// What to tokenize.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum TokenizeContent {
    Text(String),
    Mixed(Vec<TextOrToken>),
}

/// A text piece or a token id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum TextOrToken {
    Token(i64),
    Text(String),
}

/// The answer of `POST /tokenize`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TokenizeResponse {
    /// Token ids, or with `with_pieces` each id with its text.
    pub tokens: Vec<TokenOut>,
}

/// A token of the answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum TokenOut {
    Id(i32),
    WithPiece {
        id: i32,
        piece: TokenPiece,
    },
}

/// A token's text, or its bytes when they are not valid UTF-8 alone (part of a character).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum TokenPiece {
    Text(String),
    Bytes(Vec<u8>),
}

/// `POST /detokenize`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct DetokenizeRequest {
    /// Token ids of the served model.
    pub tokens: Vec<i64>,
}

/// The answer of `POST /detokenize`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct DetokenizeResponse {
    pub content: String,
}
