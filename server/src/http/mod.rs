//! The HTTP face of the head node: OpenAI's routes (chat, completions, Responses),
//! Anthropic's Messages, Ollama's API, auth, limits, what web pages may do (`guard`),
//! metrics, and the OpenAPI document.
//! Each API's handlers turn its JSON into a chat request (one preparation path) and the
//! shared turn (`turn`) back into its JSON and events, errors into its envelope
//! (`error::Dialect`); they never touch the engine directly.

mod admin;
mod anthropic;
mod chat;
mod completions;
mod console;
mod embeddings;
mod error;
mod generate;
pub mod guard;
mod json;
mod ollama;
mod prepare;
pub mod reasoning;
mod responses;
pub mod server;
mod stream;
mod tokenize;
mod tools;
mod turn;

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use engine::chat_template::ChatTemplate;
use engine::tokenizer::Tokenizer;
use openapi::{HealthResponse, Limits, ModelCard, ModelList};

pub use error::ApiError;
pub use guard::WebPolicy;
pub use responses::ResponseStore;
use error::Dialect;

use crate::runtime::Runtime;

/// What every handler shares: the runtime it reaches generation and the ring through, and
/// what the API needs of the model to prepare requests (tokenizer, chat template).
pub struct AppState {
    pub runtime: Arc<dyn Runtime>,
    pub tokenizer: Arc<Tokenizer>,
    pub template: ChatTemplate,
    /// Whether the template renders `tools` itself; if not, hearth describes them in a
    /// system message.
    pub template_knows_tools: bool,
    /// How the model writes its thinking, from its chat template: split off into
    /// `reasoning_content`.
    pub reasoning: reasoning::ReasoningFormat,
    pub model_id: String,
    pub created: u64,
    pub fingerprint: String,
    pub api_key: Option<String>,
    /// Bearer token for /admin/*; `None`: those routes are off.
    pub admin_key: Option<String>,
    pub limits: Limits,
    pub body_limit: usize,
    /// What clients are told of the model beyond its id (Ollama's tags, show and ps).
    pub facts: ModelFacts,
    /// Responses kept for `GET /v1/responses/{id}` and `previous_response_id`.
    pub responses: ResponseStore,
    /// The embedding model served beside the chat model (`--embedding-model`), if any.
    pub embeddings: Option<Arc<Embeddings>>,
    /// The Host names served and the origins whose pages may read answers
    /// (`--allowed-hosts`, `--cors-origins`).
    pub web: WebPolicy,
    /// Slots of the console's endless streams (`--max-console-streams`).
    pub endless: server::EndlessStreams,
}

/// The embedding model: its queue and what clients are told of its file.
pub struct Embeddings {
    pub service: crate::runtime::embeddings::EmbeddingService,
    pub facts: ModelFacts,
}

/// Facts of the served model's file, read once at start.
#[derive(Debug, Clone, Default)]
pub struct ModelFacts {
    /// The GGUF architecture (`llama`, `qwen3`).
    pub arch: String,
    pub parameters: u64,
    /// Bytes of all its tensors.
    pub weight_bytes: u64,
    /// llama-quantize's name of the file type, upper case (`Q4_K_M`); empty if unknown.
    pub quantization: String,
    pub context_length: usize,
    pub embedding_length: usize,
    /// The content fingerprint ring members compare (SHA-256, hex).
    pub digest: String,
}

pub fn router(state: Arc<AppState>) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/embeddings", post(embeddings::openai))
        .route("/v1/responses", post(responses::create))
        .route("/v1/responses/{id}", get(responses::retrieve).delete(responses::delete))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/console/state", get(console::state))
        .route("/detokenize", post(tokenize::detokenize))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_api_key));
    let anthropic = Router::new()
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_api_key))
        .layer(middleware::from_fn(|req, next| error::speak(Dialect::Anthropic, req, next)));
    let ollama = Router::new()
        .route("/api/tags", get(ollama::tags))
        .route("/api/ps", get(ollama::ps))
        .route("/api/show", post(ollama::show))
        .route("/api/pull", post(ollama::pull))
        .route("/api/chat", post(ollama::chat))
        .route("/api/generate", post(ollama::generate))
        .route("/api/embed", post(embeddings::ollama_embed))
        .route("/api/embeddings", post(embeddings::ollama_embeddings))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_api_key))
        // Clients check the version before anything else, with or without a key.
        .route("/api/version", get(ollama::version))
        .layer(middleware::from_fn(|req, next| error::speak(Dialect::Ollama, req, next)));
    let admin = Router::new()
        .route("/admin/plan", get(admin::plan))
        .route("/admin/replan", post(admin::replan))
        .route("/admin/cluster", get(admin::cluster))
        .route("/admin/what-if", post(admin::what_if))
        .route_layer(middleware::from_fn_with_state(state.clone(), admin::require_admin_key));
    let app = Router::new()
        .merge(api)
        .merge(anthropic)
        .merge(ollama)
        .merge(admin)
        // Clients probe the server's root before anything else (Claude Code sends `HEAD /`
        // and reads anything but 2xx as "down").
        .route("/", get(console::page))
        .route("/console/console.js", get(console::script))
        .route("/console/console.css", get(console::style))
        .route("/console/icon.svg", get(console::icon))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/openapi.json", get(openapi_json))
        .fallback(not_found);
    // Inside the Host check: a foreign name gets no grant, preflight or not.
    let app = match state.web.cors() {
        Some(cors) => app.layer(cors),
        None => app,
    };
    app.layer(middleware::from_fn_with_state(state.clone(), guard::check_host))
        .layer(middleware::from_fn(record_metrics))
        .layer(axum::extract::DefaultBodyLimit::max(state.body_limit))
        .layer(axum::Extension(json::BodyLimit(state.body_limit)))
        .with_state(state)
}

async fn require_api_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        if !api_key_is(&req, key) {
            return ApiError::Unauthorized.into_response();
        }
    }
    next.run(req).await
}

/// Whether the request carries the key as `Authorization: Bearer <key>` (OpenAI's and
/// Ollama's clients) or `x-api-key: <key>` (Anthropic's).
fn api_key_is(req: &Request, key: &str) -> bool {
    let x_api_key = req.headers().get("x-api-key").and_then(|v| v.to_str().ok());
    bearer_is(req, key) || x_api_key.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes()))
}

/// Whether the request carries `Authorization: Bearer <key>`.
fn bearer_is(req: &Request, key: &str) -> bool {
    let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes()))
}

/// Compares secrets without leaking through timing how much of a guess was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn record_metrics(req: Request, next: Next) -> Response {
    let endpoint = match req.uri().path() {
        "/v1/chat/completions" => "chat_completions",
        "/v1/completions" => "completions",
        p if p.starts_with("/v1/responses") => "responses",
        "/v1/messages" => "messages",
        "/v1/messages/count_tokens" => "count_tokens",
        "/api/chat" => "ollama_chat",
        "/api/generate" => "ollama_generate",
        "/v1/embeddings" | "/api/embed" | "/api/embeddings" => "embeddings",
        p if p.starts_with("/api/") => "ollama",
        p if p.starts_with("/v1/models") => "models",
        "/tokenize" | "/detokenize" => "tokenize",
        "/health" => "health",
        "/metrics" => "metrics",
        p if p == "/" || p.starts_with("/console/") => "console",
        "/openapi.json" => "openapi",
        p if p.starts_with("/admin/") => "admin",
        _ => "other",
    };
    let start = Instant::now();
    let resp = next.run(req).await;
    // Streaming responses are counted when their headers go out; the stream's own
    // duration shows in the generation metrics.
    crate::metrics::request(endpoint, resp.status().as_u16(), start.elapsed());
    resp
}

async fn not_found(req: Request) -> ApiError {
    ApiError::NotFound { method: req.method().to_string(), path: req.uri().path().to_string() }
}

async fn health(State(state): State<Arc<AppState>>) -> Json<HealthResponse> {
    // `degraded`: a ring member is lost; requests get 503 until the ring is whole again.
    Json(match state.runtime.degraded() {
        Some(why) => HealthResponse { status: "degraded".into(), reason: Some(why) },
        None => HealthResponse::ok(),
    })
}

fn model_card(state: &AppState) -> ModelCard {
    let mut capabilities: Vec<String> = ["chat", "completion", "tools"].map(String::from).into();
    if state.reasoning != reasoning::ReasoningFormat::None {
        capabilities.push("thinking".into());
    }
    ModelCard { capabilities, context_length: Some(state.runtime.n_ctx() as u64), ..ModelCard::new(state.model_id.clone(), state.created, "hearth") }
}

/// The embedding model's card: it makes embeddings and nothing else.
fn embedding_card(state: &AppState, e: &Embeddings) -> ModelCard {
    ModelCard { capabilities: vec!["embeddings".into()], context_length: Some(e.service.model.n_ctx as u64), ..ModelCard::new(e.service.model.id.clone(), state.created, "hearth") }
}

/// Every model served: the chat model, then the embedding model.
fn model_cards(state: &AppState) -> Vec<ModelCard> {
    let mut cards = vec![model_card(state)];
    cards.extend(state.embeddings.as_deref().map(|e| embedding_card(state, e)));
    cards
}

async fn models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList::new(model_cards(&state)))
}

async fn model(State(state): State<Arc<AppState>>, axum::extract::Path(id): axum::extract::Path<String>) -> Result<Json<ModelCard>, ApiError> {
    model_cards(&state).into_iter().find(|c| c.id == id).map(Json).ok_or(ApiError::ModelNotFound(id))
}

async fn metrics() -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], crate::metrics::render()).into_response()
}

async fn openapi_json() -> Response {
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], Body::from(openapi::spec_json())).into_response()
}

/// The one model this server serves; OpenAI clients must name it (or an empty string).
pub(crate) fn check_model(state: &AppState, model: &str) -> Result<(), ApiError> {
    if model.is_empty() || model == state.model_id {
        Ok(())
    } else {
        Err(ApiError::ModelNotFound(model.to_string()))
    }
}
