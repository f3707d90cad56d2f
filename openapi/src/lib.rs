//! OpenAI's wire types for hearth's HTTP API (serde + utoipa), their validation, and the
//! generated `openapi.json`.
//!
//! It must not depend on the engine, the scheduler or the transport: it describes
//! requests and responses, nothing more. (Filled in by the OpenAI API issue.)
