//! Ollama's API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`,
//! `/api/version`, `/api/pull`), in Ollama's shapes: for Home Assistant, Open WebUI and the
//! `ollama` client libraries. Durations are nanoseconds; times RFC 3339 strings.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use crate::chat::Tool;
use crate::error::WireError;

/// `POST /api/chat`. Unknown fields are ignored.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct OllamaChatRequest {
    /// The model as `GET /api/tags` lists it (with or without `:latest`).
    #[schema(example = "SmolLM2-135M-Instruct.Q4_1:latest")]
    pub model: String,
    /// The conversation; empty only to load the model (answered at once, `done_reason`
    /// `load`).
    #[serde(default)]
    pub messages: Vec<OllamaMessage>,
    /// Functions the model may call (OpenAI's tool shape).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Tool>>,
    /// `"json"`, or a JSON Schema the answer must follow (enforced by grammar).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub options: Option<OllamaOptions>,
    /// Stream NDJSON chunks (the default) or answer one object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    /// Thinking on or off (`true`/`false`), or a level (`low`, `medium`, `high`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub think: Option<Value>,
    /// Accepted; the model stays loaded for the server's lifetime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_alive: Option<Value>,
}

/// `POST /api/generate`. Unknown fields are ignored.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct OllamaGenerateRequest {
    #[schema(example = "SmolLM2-135M-Instruct.Q4_1:latest")]
    pub model: String,
    /// The prompt; empty or absent only to load the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// A system prompt for the chat template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<String>,
    /// The prompt is the model's whole input: no chat template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raw: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub options: Option<OllamaOptions>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub think: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_alive: Option<Value>,
    /// Images: refused (400) until hearth serves a model that can see.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub images: Option<Vec<String>>,
}

/// A chat message, sent and answered.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct OllamaMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    #[serde(default)]
    pub content: String,
    /// The model's thinking.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking: Option<String>,
    /// Images: refused (400) until hearth serves a model that can see.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub images: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<OllamaToolCall>>,
    /// On a tool message: the tool that answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_name: Option<String>,
}

/// A tool call: arguments are an object, not a string as in OpenAI's API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OllamaToolCall {
    pub function: OllamaFunctionCall,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OllamaFunctionCall {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    pub name: String,
    #[serde(default)]
    #[schema(value_type = Object)]
    pub arguments: Value,
}

/// Model options; the ones hearth has no use for (`num_gpu`, `num_thread`, `num_batch`,
/// ...) are accepted and ignored.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct OllamaOptions {
    /// Tokens to generate at most; -1 (or absent): until the model stops or the context is
    /// full.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_predict: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeat_penalty: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f32>,
    /// The context the client wants: honoured up to the server's `--ctx-size` (a larger
    /// one is refused with 400: the slots are allocated at start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_ctx: Option<u64>,
}

impl OllamaOptions {
    /// `num_ctx` within the server's context.
    pub fn check_context(&self, n_ctx: usize) -> Result<(), WireError> {
        match self.num_ctx {
            Some(n) if n as usize > n_ctx => Err(WireError::Unsupported {
                param: "options.num_ctx".into(),
                message: format!("num_ctx {n} is larger than this server's context of {n_ctx} tokens per sequence (hearth serve --ctx-size)"),
            }),
            _ => Ok(()),
        }
    }
}

/// One chunk of a streamed chat (NDJSON line), or the whole answer; the last has `done`,
/// `done_reason` and the counts and durations.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OllamaChatResponse {
    pub model: String,
    /// RFC 3339.
    pub created_at: String,
    pub message: OllamaMessage,
    pub done: bool,
    #[serde(flatten)]
    pub end: Option<OllamaEnd>,
}

/// One chunk of a streamed generation, or the whole answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OllamaGenerateResponse {
    pub model: String,
    pub created_at: String,
    pub response: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking: Option<String>,
    pub done: bool,
    #[serde(flatten)]
    pub end: Option<OllamaEnd>,
}

/// What the last chunk adds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct OllamaEnd {
    /// `stop`, `length` or `load`.
    pub done_reason: String,
    /// Nanoseconds from the request to its end.
    pub total_duration: u64,
    pub load_duration: u64,
    pub prompt_eval_count: u64,
    pub prompt_eval_duration: u64,
    pub eval_count: u64,
    pub eval_duration: u64,
}

/// `GET /api/version`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct OllamaVersion {
    /// The version of Ollama's API hearth follows.
    pub version: String,
}

/// `GET /api/tags`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OllamaTags {
    pub models: Vec<OllamaModel>,
}

/// A model in `GET /api/tags`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OllamaModel {
    /// `<model>:latest`.
    pub name: String,
    pub model: String,
    pub modified_at: String,
    /// Bytes of the model's weights.
    pub size: u64,
    /// The model's content fingerprint (SHA-256, hex).
    pub digest: String,
    pub details: OllamaDetails,
    /// `completion`, `tools`, `thinking`.
    pub capabilities: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OllamaDetails {
    pub parent_model: String,
    /// Always `gguf`.
    pub format: String,
    /// The GGUF architecture (`llama`, `qwen3`, ...).
    pub family: String,
    pub families: Vec<String>,
    /// `135M`, `70.6B`.
    pub parameter_size: String,
    /// `Q4_K_M`, `Q8_0`, ...
    pub quantization_level: String,
    pub context_length: u64,
    pub embedding_length: u64,
}

/// `GET /api/ps`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OllamaRunning {
    pub models: Vec<OllamaRunningModel>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OllamaRunningModel {
    pub name: String,
    pub model: String,
    pub size: u64,
    pub digest: String,
    pub details: OllamaDetails,
    /// Far in the future: hearth keeps its model loaded.
    pub expires_at: String,
    pub size_vram: u64,
    pub context_length: u64,
}

/// `POST /api/show` and `POST /api/pull` name a model as `model` (or the older `name`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct OllamaModelRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `pull`: stream progress lines (the default) or answer once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
}

impl OllamaModelRequest {
    pub fn named(&self) -> &str {
        self.model.as_deref().or(self.name.as_deref()).unwrap_or_default()
    }
}

/// `POST /api/show`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OllamaShow {
    pub modelfile: String,
    /// Ollama's parameter lines (`num_ctx 4096`).
    pub parameters: String,
    /// The chat template (Jinja, as the GGUF holds it).
    pub template: String,
    pub details: OllamaDetails,
    /// GGUF facts under their keys (`general.architecture`, `<arch>.context_length`, ...).
    #[schema(value_type = Object)]
    pub model_info: Value,
    pub capabilities: Vec<String>,
    pub modified_at: String,
}

/// `POST /api/pull`: the served model is already here.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct OllamaStatus {
    /// `success`.
    pub status: String,
}

/// Ollama's error envelope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct OllamaError {
    pub error: String,
}

/// `think`: on, off, or a level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Think {
    On,
    Off,
    Level(&'static str),
}

/// Reads `think` (`true`, `false`, `"low"`, `"medium"`, `"high"`; `"max"` reads as high).
pub fn parse_think(v: Option<&Value>) -> Result<Option<Think>, WireError> {
    Ok(match v {
        None | Some(Value::Null) => None,
        Some(Value::Bool(true)) => Some(Think::On),
        Some(Value::Bool(false)) => Some(Think::Off),
        Some(Value::String(s)) => Some(Think::Level(match s.as_str() {
            "low" => "low",
            "medium" => "medium",
            "high" | "max" => "high",
            other => return Err(WireError::InvalidParameter { param: "think".into(), message: format!("think: expected true, false, \"low\", \"medium\" or \"high\", got \"{other}\"") }),
        })),
        Some(other) => return Err(WireError::InvalidParameter { param: "think".into(), message: format!("think: expected a boolean or a level, got {other}") }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn home_assistant_shaped_requests_parse() {
        let body = json!({"model": "m:latest", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "HassTurnOn", "arguments": {"name": "kitchen"}}}]},
            {"role": "tool", "content": "{\"success\": true}"}],
            "stream": true, "keep_alive": -1, "options": {"num_ctx": 8192, "num_gpu": 99}, "think": null,
            "tools": [{"type": "function", "function": {"name": "HassTurnOn", "parameters": {"type": "object"}}}]});
        let r: OllamaChatRequest = serde_json::from_value(body).unwrap();
        assert_eq!(r.options.as_ref().unwrap().num_ctx, Some(8192));
        assert!(r.options.unwrap().check_context(4096).is_err());
        assert_eq!(parse_think(r.think.as_ref()).unwrap(), None);
        assert_eq!(parse_think(Some(&json!("max"))).unwrap(), Some(Think::Level("high")));
        assert!(parse_think(Some(&json!(3))).is_err());
    }

    #[test]
    fn the_last_chunk_carries_counts_at_the_top_level() {
        let end = OllamaEnd { done_reason: "stop".into(), total_duration: 5, load_duration: 0, prompt_eval_count: 2, prompt_eval_duration: 1, eval_count: 3, eval_duration: 4 };
        let r = OllamaChatResponse { model: "m".into(), created_at: "t".into(), message: OllamaMessage { role: "assistant".into(), ..Default::default() }, done: true, end: Some(end) };
        let v = serde_json::to_value(r).unwrap();
        assert_eq!(v["done_reason"], "stop");
        assert_eq!(v["eval_count"], 3);
        let r = OllamaChatResponse { model: "m".into(), created_at: "t".into(), message: OllamaMessage { role: "assistant".into(), content: "Hi".into(), ..Default::default() }, done: false, end: None };
        assert_eq!(serde_json::to_value(r).unwrap(), json!({"model": "m", "created_at": "t", "message": {"role": "assistant", "content": "Hi"}, "done": false}));
    }
}
