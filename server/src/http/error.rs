//! THE place where errors become HTTP responses: the API's own refusals, the runtime's
//! (`SubmitError`, `ReplanError`) and the engine's, in the envelope of the API the route
//! belongs to ([`Dialect`]): OpenAI's `{"error": {"message", "type", "param", "code"}}`,
//! Anthropic's `{"type": "error", "error": {"type", "message"}}`, Ollama's `{"error": "..."}`.

use std::sync::Arc;

use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use openapi::{AnthropicErrorBody, AnthropicErrorResponse, ErrorBody, ErrorResponse, WireError};

use crate::error::ReplanError;
use crate::runtime::generation::SubmitError;

#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    #[error("{message}")]
    InvalidParameter { param: Option<String>, message: String },
    #[error("{0}")]
    InvalidJson(String),
    /// One wording in every API: Anthropic's own ("prompt is too long: N tokens > M
    /// maximum", which Claude Code reads to compact the conversation) and OpenAI's ("maximum
    /// context length", which OpenAI clients match). `limit`: the longest prompt taken
    /// (a generation keeps one cell of `max` for its answer).
    #[error("prompt is too long: {prompt} tokens > {limit} maximum; this model's maximum context length is {max} tokens (hearth serve --ctx-size)")]
    ContextLengthExceeded { max: usize, limit: usize, prompt: usize, field: &'static str },
    /// Found from the prompt's size alone, before tokenizing it.
    #[error("prompt is too long: {at_least} tokens > {limit} maximum (at least {at_least}, counted from its size); this model's maximum context length is {max} tokens (hearth serve --ctx-size)")]
    PromptTooLong { max: usize, limit: usize, at_least: usize, field: &'static str },
    #[error("The model `{0}` does not exist")]
    ModelNotFound(String),
    #[error("Incorrect API key provided. Send `Authorization: Bearer <key>` (or `x-api-key: <key>`) with the key the server was started with.")]
    Unauthorized,
    #[error("The admin endpoints are off: start hearth serve with --admin-key (or HEARTH_ADMIN_KEY) to use them")]
    AdminDisabled,
    #[error("Incorrect admin key provided. Send `Authorization: Bearer <key>` with the --admin-key the server was started with.")]
    AdminUnauthorized,
    /// The request is valid but cannot be done in this state; the message says why.
    #[error("{0}")]
    Conflict(String),
    #[error("No response with id '{0}' is stored (responses are kept in memory, the oldest dropped first)")]
    ResponseNotFound(String),
    #[error("Unknown route {method} {path}")]
    NotFound { method: String, path: String },
    #[error("Request body is larger than the limit of {limit} bytes")]
    PayloadTooLarge { limit: usize },
    /// A JSON route sent a body that is not declared JSON (what a web page can send
    /// anywhere unasked); the type given, if any.
    #[error("The request body must be JSON: send `Content-Type: application/json`{}", .0.as_deref().map_or_else(|| " (a request from a web page must say so)".to_string(), |t| format!(" (got `{t}`)")))]
    UnsupportedMediaType(Option<String>),
    /// The request names the server by a host name it does not answer to (a guard against
    /// DNS rebinding); the name given.
    #[error("The host `{0}` is not a name this server answers to: use its IP address or localhost, or start hearth with --allowed-hosts NAME (HEARTH_ALLOWED_HOSTS; `*` turns the check off, e.g. behind a reverse proxy)")]
    HostNotAllowed(String),
    /// Every slot for endless streams (`--max-console-streams`) is taken.
    #[error("{cap} console streams are open, the most --max-console-streams allows: close a console tab, or retry")]
    TooManyStreams { cap: usize },
    #[error("The server is at capacity: all sequence slots are busy and the queue is full. Retry shortly.")]
    QueueFull,
    /// Every request-preparation thread is busy and its queue is full.
    #[error("The server is at capacity: too many requests are waiting to be prepared (templated, tokenized, turned into grammars). Retry shortly.")]
    PreparationBusy,
    #[error("The server is shutting down")]
    ShuttingDown,
    /// A ring member failed, or the model file changed under the node; the message says
    /// which.
    #[error("The server is unavailable: {0}")]
    Unavailable(String),
    /// Rendering these messages through the chat template passed a bound of work, output,
    /// memory or time (`engine::chat_template::Bounds`, `engine::template_sandbox`). A 400,
    /// not a 500: the template was probed at start within the same bounds, so what blows
    /// them now is this request's input (a conversation far larger than the work it may
    /// take, or text that sets off a trap in the template), and a 5xx would have the SDKs
    /// retry it, running the same render again. The server logs it with the template's
    /// source for the operator.
    #[error("The model's chat template could not render these messages within its bounds: {0}")]
    TemplateLimit(String),
    /// The message is logged, never sent: clients see a generic 500.
    #[error("internal error: {0}")]
    Internal(String),
}

/// The API whose envelope errors go out in. Routes of one API are grouped, and the
/// group's layer ([`speak`]) renders every error its handlers, extractors and auth raise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    OpenAi,
    Anthropic,
    Ollama,
}

/// Anthropic's status for "overloaded": the server is at capacity.
const ANTHROPIC_OVERLOADED: u16 = 529;

/// Every error response carries its error, so that a route group of another API can
/// answer it in that API's envelope.
#[derive(Clone)]
struct Raised(Arc<ApiError>);

/// Seconds a client should wait before retrying when the queue is full: about the time a
/// short generation takes to free a slot.
const RETRY_AFTER_SECS: &str = "1";

impl From<WireError> for ApiError {
    fn from(e: WireError) -> Self {
        ApiError::InvalidParameter { param: Some(e.param().to_string()), message: e.to_string() }
    }
}

impl From<engine::Error> for ApiError {
    fn from(e: engine::Error) -> Self {
        match e {
            engine::Error::ChatTemplate(m) => ApiError::InvalidParameter { param: Some("messages".into()), message: format!("the model's chat template rejected the messages: {m}") },
            engine::Error::Sampler(m) => ApiError::InvalidParameter { param: None, message: m },
            engine::Error::TemplateLimit(m) => {
                tracing::warn!("a chat render passed its bounds: {m}");
                ApiError::TemplateLimit(m)
            }
            other => ApiError::Internal(other.to_string()),
        }
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::QueueFull => ApiError::QueueFull,
            SubmitError::ShuttingDown => ApiError::ShuttingDown,
            SubmitError::Unavailable(why) => ApiError::Unavailable(why),
        }
    }
}

impl From<ReplanError> for ApiError {
    fn from(e: ReplanError) -> Self {
        match e {
            ReplanError::ShuttingDown => ApiError::ShuttingDown,
            ReplanError::NotARing | ReplanError::Broken(_) | ReplanError::Failed(_) => ApiError::Conflict(e.to_string()),
            ReplanError::WhatIf { param, message } => ApiError::InvalidParameter { param: Some(param.to_string()), message },
        }
    }
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidParameter { .. } | ApiError::TemplateLimit(_) | ApiError::InvalidJson(_) | ApiError::ContextLengthExceeded { .. } | ApiError::PromptTooLong { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized | ApiError::AdminUnauthorized => StatusCode::UNAUTHORIZED,
            ApiError::AdminDisabled | ApiError::HostNotAllowed(_) => StatusCode::FORBIDDEN,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            // OpenAI answers an unknown model with 404 (the SDKs' NotFoundError).
            ApiError::NotFound { .. } | ApiError::ModelNotFound(_) | ApiError::ResponseNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::QueueFull | ApiError::PreparationBusy => StatusCode::TOO_MANY_REQUESTS,
            ApiError::ShuttingDown | ApiError::Unavailable(_) | ApiError::TooManyStreams { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn body(&self) -> ErrorResponse {
        let (kind, param, code) = match self {
            ApiError::InvalidParameter { param, .. } => ("invalid_request_error", param.clone(), None),
            ApiError::InvalidJson(_) => ("invalid_request_error", None, Some("invalid_json")),
            ApiError::TemplateLimit(_) => ("invalid_request_error", Some("messages".to_string()), Some("chat_template_limit")),
            ApiError::ContextLengthExceeded { field, .. } | ApiError::PromptTooLong { field, .. } => ("invalid_request_error", Some(field.to_string()), Some("context_length_exceeded")),
            ApiError::ModelNotFound(_) => ("invalid_request_error", Some("model".to_string()), Some("model_not_found")),
            ApiError::Unauthorized => ("invalid_request_error", None, Some("invalid_api_key")),
            ApiError::AdminUnauthorized => ("invalid_request_error", None, Some("invalid_admin_key")),
            ApiError::AdminDisabled => ("invalid_request_error", None, Some("admin_disabled")),
            ApiError::Conflict(_) => ("invalid_request_error", None, Some("conflict")),
            ApiError::NotFound { .. } => ("invalid_request_error", None, Some("unknown_url")),
            ApiError::ResponseNotFound(_) => ("invalid_request_error", None, Some("response_not_found")),
            ApiError::PayloadTooLarge { .. } => ("invalid_request_error", None, Some("request_too_large")),
            ApiError::UnsupportedMediaType(_) => ("invalid_request_error", None, Some("unsupported_media_type")),
            ApiError::HostNotAllowed(_) => ("invalid_request_error", None, Some("host_not_allowed")),
            ApiError::TooManyStreams { .. } => ("server_error", None, Some("too_many_streams")),
            ApiError::QueueFull | ApiError::PreparationBusy => ("rate_limit_exceeded", None, Some("rate_limit_exceeded")),
            ApiError::ShuttingDown => ("server_error", None, Some("shutting_down")),
            ApiError::Unavailable(_) => ("server_error", None, Some("ring_unavailable")),
            ApiError::Internal(_) => ("server_error", None, None),
        };
        let message = match self {
            ApiError::Internal(_) => "The server had an error while processing your request.".to_string(),
            other => other.to_string(),
        };
        ErrorResponse { error: ErrorBody { message, kind: kind.to_string(), param, code: code.map(str::to_string) } }
    }
}

impl ApiError {
    /// The status and body in Anthropic's terms.
    pub fn anthropic(&self) -> (StatusCode, AnthropicErrorResponse) {
        let (status, kind) = match self {
            ApiError::QueueFull | ApiError::PreparationBusy => (StatusCode::from_u16(ANTHROPIC_OVERLOADED).expect("a valid status"), "overloaded_error"),
            other => {
                let status = other.status();
                let kind = match status {
                    StatusCode::UNAUTHORIZED => "authentication_error",
                    StatusCode::FORBIDDEN => "permission_error",
                    StatusCode::NOT_FOUND => "not_found_error",
                    StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
                    StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
                    s if s.is_server_error() => "api_error",
                    _ => "invalid_request_error",
                };
                (status, kind)
            }
        };
        let message = self.body().error.message;
        (status, AnthropicErrorResponse { kind: Default::default(), error: AnthropicErrorBody { kind: kind.into(), message } })
    }

    /// The response in `dialect`'s envelope.
    fn response_in(&self, dialect: Dialect) -> Response {
        let mut resp = match dialect {
            Dialect::OpenAi => (self.status(), axum::Json(self.body())).into_response(),
            Dialect::Anthropic => {
                let (status, body) = self.anthropic();
                (status, axum::Json(body)).into_response()
            }
            Dialect::Ollama => (self.status(), axum::Json(serde_json::json!({"error": self.body().error.message}))).into_response(),
        };
        if matches!(self, ApiError::QueueFull | ApiError::PreparationBusy | ApiError::ShuttingDown | ApiError::Unavailable(_) | ApiError::TooManyStreams { .. }) {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static(RETRY_AFTER_SECS));
        }
        resp
    }
}

impl Dialect {
    /// The API a path belongs to, for a refusal made before routing (the Host check):
    /// the paths [`super::router`] groups under Anthropic's and Ollama's envelopes.
    pub fn of_path(path: &str) -> Dialect {
        if path == "/v1/messages" || path.starts_with("/v1/messages/") {
            Dialect::Anthropic
        } else if path.starts_with("/api/") {
            Dialect::Ollama
        } else {
            Dialect::OpenAi
        }
    }
}

impl ApiError {
    /// The refusal of a request to `path` made outside the route groups, in the envelope
    /// of the API that path belongs to.
    pub fn into_response_at(self, path: &str) -> Response {
        self.response_in(Dialect::of_path(path))
    }
}

/// Layer of a route group: its errors in `dialect`'s envelope.
pub async fn speak(dialect: Dialect, req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    match resp.extensions().get::<Raised>() {
        Some(Raised(e)) if dialect != Dialect::OpenAi => e.response_in(dialect),
        _ => resp,
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if let ApiError::Internal(detail) = &self {
            tracing::error!("internal error: {detail}");
        }
        let mut resp = self.response_in(Dialect::OpenAi);
        resp.extensions_mut().insert(Raised(Arc::new(self)));
        resp
    }
}
