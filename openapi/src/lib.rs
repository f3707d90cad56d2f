//! The wire types of hearth's HTTP APIs (serde + utoipa): OpenAI's chat, completions and
//! Responses and embeddings, Anthropic's Messages, Ollama's, llama-server's tokenize; their validation;
//! and the generated OpenAPI document (`openapi/openapi.json`).
//!
//! The server parses requests into these types, calls `validate`, turns them into engine
//! calls, and builds responses and stream chunks from them. The crate describes requests
//! and responses and nothing more: it must not depend on the engine, the scheduler, the
//! transport or the server, nor on any web framework, so that clients and tests can use it
//! cheaply and no API's JSON leaks below the server.

#[macro_use]
mod sampling;
mod anthropic;
mod chat;
mod completions;
mod console;
mod embeddings;
mod error;
mod generation;
mod models;
mod ollama;
mod responses;
mod spec;
mod tokenize;
mod validate;

pub use anthropic::*;
pub use chat::*;
pub use completions::*;
pub use console::*;
pub use embeddings::*;
pub use error::*;
pub use generation::{
    FinishReason, ListObject, PromptTokensDetails, Stop, StreamOptions, Usage, LOGPROB_FLOOR,
};
pub use models::*;
pub use ollama::*;
pub use responses::*;
pub use sampling::SamplingOptions;
pub use tokenize::*;
pub use spec::{spec, spec_json, ApiDoc, HealthResponse, ReplanRequest};
pub use validate::{
    parse_logit_bias, Limits, SchemaLimits, MAX_COMPLETION_LOGPROBS, MAX_LOGIT_BIAS, MAX_MESSAGES,
    MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, MAX_SCHEMA_ENUM_VALUES, MAX_SCHEMA_PROPERTIES,
    MAX_STOP_BYTES, MAX_TOOLS,
};
