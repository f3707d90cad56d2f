//! A JSON body extractor whose failures are OpenAI-style errors: a body not declared JSON
//! is 415 (`guard::json_content`), malformed JSON and wrong field types are 400 with
//! serde's message, oversized bodies 413.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use serde::de::DeserializeOwned;

use super::error::ApiError;

pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        // Before the body is read: a refused request costs nothing and runs nothing.
        super::guard::json_content(req.headers())?;
        let limit = req.extensions().get::<BodyLimit>().map(|l| l.0);
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::PayloadTooLarge { limit: limit.unwrap_or(0) }
            } else {
                ApiError::InvalidJson(format!("could not read the request body: {e}"))
            }
        })?;
        serde_json::from_slice(&bytes).map(ApiJson).map_err(|e| ApiError::InvalidJson(format!("invalid JSON body: {e}")))
    }
}

/// The configured body limit, put in request extensions so 413 errors can name it.
#[derive(Clone, Copy)]
pub struct BodyLimit(pub usize);
