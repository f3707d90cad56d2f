//! Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`): the
//! request with its content blocks, tools and thinking switch, the message answered, the
//! streaming events and Anthropic's error envelope, in Anthropic's shapes.
//!
//! Fields hearth has no use for (`cache_control`, `service_tier`, `container`, ...) are
//! accepted and ignored, as the issue of clients such as Claude Code sending them demands.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use crate::error::WireError;
use crate::generation::constant_tag;

constant_tag!(
    /// Always `"message"`.
    MessageObject::Message = "message"
);
constant_tag!(
    /// Always `"error"`.
    ErrorObject::Error = "error"
);
constant_tag!(
    /// Always `"assistant"`.
    AnthropicAssistantRole::Assistant = "assistant"
);

/// A Messages request. Unknown fields are ignored.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct MessagesRequest {
    /// The model. Any `claude-*` name means the model this server serves (clients such as
    /// Claude Code name Claude models); otherwise as listed by `GET /v1/models`.
    #[schema(example = "claude-sonnet-4-6")]
    pub model: String,
    /// The most tokens to generate (required, as Anthropic requires it).
    #[schema(minimum = 1)]
    pub max_tokens: u32,
    /// The conversation, oldest first: `user` and `assistant` turns, and `system` turns
    /// (Claude Code sends them; text only). A last `assistant` turn is a prefill that the
    /// answer continues.
    pub messages: Vec<InputMessage>,
    /// System prompt: a string or text blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<SystemPrompt>,
    /// Generation ends before the first of these; `stop_reason` is then `stop_sequence`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop_sequences: Option<Vec<String>>,
    /// Stream the answer as server-sent events (Anthropic's event sequence).
    #[serde(default)]
    #[schema(default = false)]
    pub stream: bool,
    /// Sampling temperature, 0 to 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.0, maximum = 1.0)]
    pub temperature: Option<f32>,
    /// Nucleus sampling: keep the smallest set of tokens whose probability adds up to this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.0, maximum = 1.0)]
    pub top_p: Option<f32>,
    /// Sample from the k most likely tokens only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0)]
    pub top_k: Option<i32>,
    /// Accepted; `user_id` is not used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<Value>,
    /// Tools the model may call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<AnthropicTool>>,
    /// Whether and which tool the model must call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<AnthropicToolChoice>,
    /// Extended thinking: switches the chat template's thinking on or off (models that
    /// think); `budget_tokens` is not enforced separately from `max_tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking: Option<ThinkingConfig>,
    /// Structured output (`format`: the answer follows a JSON Schema, enforced by
    /// grammar) and `effort` (passed to templates that read `reasoning_effort`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_config: Option<OutputConfig>,
}

/// `output_config`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct OutputConfig {
    /// `low`, `medium`, `high`, `xhigh` or `max` (the last two read as `high`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effort: Option<Effort>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<JsonOutputFormat>,
}

/// How much effort the model puts into its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Effort {
    Low,
    Medium,
    High,
    Xhigh,
    Max,
}

/// The answer's format: JSON following `schema`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JsonOutputFormat {
    /// Always `json_schema`.
    #[serde(rename = "type")]
    #[schema(pattern = "^json_schema$")]
    pub kind: String,
    #[schema(value_type = Object)]
    pub schema: Value,
}

/// `POST /v1/messages/count_tokens`: a Messages request without the generation settings.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct CountTokensRequest {
    /// As in a Messages request.
    #[schema(example = "claude-sonnet-4-6")]
    pub model: String,
    /// As in a Messages request.
    pub messages: Vec<InputMessage>,
    /// As in a Messages request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system: Option<SystemPrompt>,
    /// As in a Messages request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<AnthropicTool>>,
    /// As in a Messages request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<AnthropicToolChoice>,
    /// As in a Messages request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking: Option<ThinkingConfig>,
}

impl From<CountTokensRequest> for MessagesRequest {
    fn from(r: CountTokensRequest) -> Self {
        MessagesRequest {
            model: r.model,
            max_tokens: 1,
            messages: r.messages,
            system: r.system,
            tools: r.tools,
            tool_choice: r.tool_choice,
            thinking: r.thinking,
            ..MessagesRequest::default()
        }
    }
}

/// The answer of `POST /v1/messages/count_tokens`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct CountTokensResponse {
    /// Tokens of the prompt the request renders to (system, messages and tools).
    pub input_tokens: u32,
}

/// A system prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum SystemPrompt {
    Text(String),
    Blocks(Vec<SystemBlock>),
}

/// How Claude Code's first system block begins: `x-anthropic-billing-header: cc_version=…;
/// cc_entrypoint=…; cch=…;`. It is billing metadata for Anthropic's servers, not an
/// instruction to the model, and it changes with each conversation's first prompt: at the
/// head of the prompt it made every new conversation recompute the whole system prompt and
/// tools behind it (~12k tokens, 119 s cold instead of 1.2 s). So it never reaches the
/// prompt; dropping it rather than moving it after the stable part keeps the model's input
/// free of text it was never meant to read.
pub const BILLING_HEADER_PREFIX: &str = "x-anthropic-billing-header:";

impl SystemPrompt {
    /// The prompt's text, blocks joined by a blank line, without Claude Code's billing
    /// header block (`BILLING_HEADER_PREFIX`).
    pub fn text(&self) -> String {
        match self {
            SystemPrompt::Text(t) if is_billing_header(t) => String::new(),
            SystemPrompt::Text(t) => t.clone(),
            SystemPrompt::Blocks(b) => b.iter().map(|b| b.text.as_str()).filter(|t| !is_billing_header(t)).collect::<Vec<_>>().join("\n\n"),
        }
    }
}

/// Whether a system block is Claude Code's billing header.
pub fn is_billing_header(text: &str) -> bool {
    text.trim_start().starts_with(BILLING_HEADER_PREFIX)
}

/// A text block of the system prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SystemBlock {
    /// Always `"text"`.
    #[serde(rename = "type")]
    #[schema(pattern = "^text$")]
    pub kind: String,
    pub text: String,
}

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum AnthropicRole {
    User,
    Assistant,
    /// Instructions inside the conversation (Anthropic's mid-conversation system
    /// messages; Claude Code sends one in its first request).
    System,
}

/// One turn of the conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct InputMessage {
    pub role: AnthropicRole,
    pub content: InputContent,
}

/// A turn's content: a string or content blocks.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(untagged)]
pub enum InputContent {
    Text(String),
    Blocks(Vec<InputBlock>),
}

/// By hand, so that a wrong block says which (serde's untagged enums only say that nothing
/// matched).
impl<'de> Deserialize<'de> for InputContent {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        match Value::deserialize(d)? {
            Value::String(s) => Ok(InputContent::Text(s)),
            v @ Value::Array(_) => serde_json::from_value(v).map(InputContent::Blocks).map_err(D::Error::custom),
            _ => Err(D::Error::custom("content: expected a string or an array of content blocks")),
        }
    }
}

/// A content block a client sends.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum InputBlock {
    /// Text.
    Text { text: String },
    /// An image: refused (400) until hearth serves a model that can see.
    Image {
        #[schema(value_type = Object)]
        source: Value,
    },
    /// A tool call the assistant made earlier.
    ToolUse {
        id: String,
        name: String,
        #[schema(value_type = Object)]
        input: Value,
    },
    /// What a tool call gave back.
    ToolResult {
        tool_use_id: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        content: Option<ToolResultContent>,
        /// The tool failed; its content says how.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        is_error: Option<bool>,
    },
    /// Thinking the assistant did earlier, passed back.
    Thinking {
        thinking: String,
        #[serde(default)]
        signature: String,
    },
    /// Thinking passed back in a form hearth cannot read: dropped.
    RedactedThinking { data: String },
}

/// What a tool gave back: a string or blocks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum ToolResultContent {
    Text(String),
    Blocks(Vec<ToolResultBlock>),
}

/// A block of a tool's result.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToolResultBlock {
    Text { text: String },
    /// Refused (400), as images elsewhere.
    Image {
        #[schema(value_type = Object)]
        source: Value,
    },
}

/// A tool the model may call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct AnthropicTool {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The JSON Schema of the tool's input. Anthropic's server tools, which have none, are
    /// refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Object)]
    pub input_schema: Option<Value>,
    /// `custom` or absent for client tools.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
}

/// How the model must use tools.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum AnthropicToolChoice {
    /// The model decides.
    Auto {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        disable_parallel_tool_use: Option<bool>,
    },
    /// The model must call one of the tools.
    Any {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        disable_parallel_tool_use: Option<bool>,
    },
    /// The model must call this tool.
    Tool {
        name: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        disable_parallel_tool_use: Option<bool>,
    },
    /// The model must not call tools.
    None,
}

impl AnthropicToolChoice {
    /// At most one tool call per turn.
    pub fn single(&self) -> bool {
        match self {
            AnthropicToolChoice::Auto { disable_parallel_tool_use } | AnthropicToolChoice::Any { disable_parallel_tool_use } | AnthropicToolChoice::Tool { disable_parallel_tool_use, .. } => {
                disable_parallel_tool_use.unwrap_or(false)
            }
            AnthropicToolChoice::None => false,
        }
    }
}

/// Extended thinking.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ThinkingConfig {
    /// Think before answering.
    Enabled {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        #[schema(minimum = 1)]
        budget_tokens: Option<u32>,
    },
    /// Answer without thinking.
    Disabled,
    /// The model decides (its template's default).
    Adaptive,
    /// Newer modes (`between_tools`, ...): the template's default.
    #[serde(other)]
    Other,
}

/// The message answered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MessagesResponse {
    /// `msg_...`.
    pub id: String,
    #[serde(rename = "type")]
    pub kind: MessageObject,
    pub role: AnthropicAssistantRole,
    /// Thinking, text and tool calls, in the order the model made them.
    pub content: Vec<OutputBlock>,
    /// The model as the request named it.
    pub model: String,
    /// Why generation ended; `null` only in `message_start`.
    pub stop_reason: Option<StopReason>,
    /// The stop sequence that ended generation, else `null`.
    pub stop_sequence: Option<String>,
    pub usage: AnthropicUsage,
}

/// A content block the model made.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputBlock {
    Text { text: String },
    /// `signature` is empty: hearth does not sign thinking.
    Thinking { thinking: String, signature: String },
    ToolUse {
        /// `toolu_...`.
        id: String,
        name: String,
        #[schema(value_type = Object)]
        input: Value,
    },
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model finished its turn.
    EndTurn,
    /// `max_tokens` or the context ran out.
    MaxTokens,
    /// One of `stop_sequences`.
    StopSequence,
    /// The model called tools.
    ToolUse,
}

/// Token counts. `input_tokens` excludes the prompt tokens reused from the cache, which
/// are `cache_read_input_tokens`; their sum is the prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
pub struct AnthropicUsage {
    pub input_tokens: u32,
    pub output_tokens: u32,
    /// Always 0: nothing is written to a prompt cache on request.
    pub cache_creation_input_tokens: u32,
    pub cache_read_input_tokens: u32,
}

/// One server-sent event of a streamed message; the SSE `event:` name is `type`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum MessageStreamEvent {
    /// First: the message with empty content.
    MessageStart { message: MessagesResponse },
    /// A block begins at `index` (its position in the message's content).
    ContentBlockStart { index: u32, content_block: OutputBlock },
    /// More of block `index`.
    ContentBlockDelta { index: u32, delta: BlockDelta },
    /// Block `index` is complete.
    ContentBlockStop { index: u32 },
    /// The message's end: why, and the output tokens so far.
    MessageDelta { delta: MessageDeltaBody, usage: MessageDeltaUsage },
    /// Last.
    MessageStop,
    /// Keep-alive.
    Ping,
    /// Generation failed after the stream began.
    Error { error: AnthropicErrorBody },
}

/// A piece of a block.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum BlockDelta {
    TextDelta { text: String },
    /// A fragment of a tool call's input as JSON text; the fragments make the input.
    InputJsonDelta { partial_json: String },
    ThinkingDelta { thinking: String },
    SignatureDelta { signature: String },
}

/// The end of a streamed message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MessageDeltaBody {
    pub stop_reason: Option<StopReason>,
    pub stop_sequence: Option<String>,
}

/// The usage of a streamed message at its end (cumulative).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct MessageDeltaUsage {
    pub output_tokens: u32,
    pub input_tokens: u32,
    pub cache_creation_input_tokens: u32,
    pub cache_read_input_tokens: u32,
}

/// Anthropic's error envelope: `{"type": "error", "error": {"type", "message"}}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct AnthropicErrorResponse {
    #[serde(rename = "type")]
    pub kind: ErrorObject,
    pub error: AnthropicErrorBody,
}

/// What went wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct AnthropicErrorBody {
    /// `invalid_request_error`, `authentication_error`, `permission_error`,
    /// `not_found_error`, `request_too_large`, `rate_limit_error`, `api_error`,
    /// `overloaded_error`.
    #[serde(rename = "type")]
    #[schema(example = "invalid_request_error")]
    pub kind: String,
    pub message: String,
}

/// Stop sequences Anthropic's requests may carry at most (its API sets no small cap as
/// OpenAI's 4; each one costs a matcher per generated byte).
pub const MAX_STOP_SEQUENCES: usize = 16;

impl MessagesRequest {
    /// Anthropic's own rules, before the request is turned into a chat request (which is
    /// validated as well).
    pub fn validate(&self) -> Result<(), WireError> {
        let invalid = |param: &str, message: String| WireError::InvalidParameter { param: param.into(), message };
        if self.max_tokens == 0 {
            return Err(invalid("max_tokens", "max_tokens: must be at least 1".into()));
        }
        for (name, v) in [("temperature", self.temperature), ("top_p", self.top_p)] {
            if let Some(v) = v {
                if !(0.0..=1.0).contains(&v) {
                    return Err(invalid(name, format!("{name}: must be between 0 and 1, got {v}")));
                }
            }
        }
        if self.top_k.is_some_and(|k| k < 0) {
            return Err(invalid("top_k", "top_k: must not be negative".into()));
        }
        let stops = self.stop_sequences.as_deref().unwrap_or_default();
        if stops.len() > MAX_STOP_SEQUENCES {
            return Err(invalid("stop_sequences", format!("stop_sequences: at most {MAX_STOP_SEQUENCES} are allowed, got {}", stops.len())));
        }
        if stops.iter().any(|s| s.is_empty()) {
            return Err(invalid("stop_sequences", "stop_sequences: a stop sequence must not be empty".into()));
        }
        if stops.iter().any(|s| s.len() > crate::MAX_STOP_BYTES) {
            return Err(invalid("stop_sequences", format!("stop_sequences: a stop sequence may be at most {} bytes long", crate::MAX_STOP_BYTES)));
        }
        for (i, t) in self.tools.iter().flatten().enumerate() {
            if t.input_schema.is_none() {
                return Err(invalid(
                    &format!("tools[{i}]"),
                    format!("tools.{i}: `{}` has no input_schema; Anthropic's server tools ({}) are not available on this server", t.name, t.kind.as_deref().unwrap_or("no type")),
                ));
            }
        }
        if let Some(f) = self.output_config.as_ref().and_then(|o| o.format.as_ref()) {
            if f.kind != "json_schema" {
                return Err(invalid("output_config.format.type", format!("output_config.format.type: expected `json_schema`, got `{}`", f.kind)));
            }
        }
        if let Some(AnthropicToolChoice::Tool { name, .. }) = &self.tool_choice {
            if !self.tools.iter().flatten().any(|t| &t.name == name) {
                return Err(invalid("tool_choice", format!("tool_choice: the tool `{name}` is not among the request's tools")));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn claude_code_shaped_requests_parse() {
        let body = json!({
            "model": "claude-sonnet-4-6", "max_tokens": 32000, "stream": true,
            "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "abc"}, {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"path": "a"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "file"}], "is_error": false}]}
            ],
            "tools": [{"name": "Read", "description": "reads", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "auto", "disable_parallel_tool_use": true},
            "thinking": {"type": "enabled", "budget_tokens": 2048},
            "metadata": {"user_id": "u"}, "context_management": {}, "output_config": {"effort": "high"}
        });
        let r: MessagesRequest = serde_json::from_value(body).unwrap();
        r.validate().unwrap();
        assert_eq!(r.system.unwrap().text(), "You are Claude Code.");
        assert!(r.tool_choice.unwrap().single());
        assert_eq!(r.messages.len(), 3);
    }

    #[test]
    fn system_turns_parse_and_the_billing_header_is_no_part_of_the_system_prompt() {
        let body = json!({
            "model": "claude-sonnet-4-6", "max_tokens": 10,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.3.a1b; cc_entrypoint=cli; cch=00000;"}, {"type": "text", "text": "You are Claude Code."}],
            "messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": [{"type": "text", "text": "Answer in French."}]}]
        });
        let r: MessagesRequest = serde_json::from_value(body).unwrap();
        r.validate().unwrap();
        assert_eq!(r.messages[1].role, AnthropicRole::System);
        assert_eq!(r.system.unwrap().text(), "You are Claude Code.");
        assert_eq!(SystemPrompt::Text("x-anthropic-billing-header: cc_version=1;".into()).text(), "");
    }

    #[test]
    fn events_carry_anthropic_names() {
        let e = MessageStreamEvent::ContentBlockDelta { index: 1, delta: BlockDelta::InputJsonDelta { partial_json: "{}".into() } };
        assert_eq!(serde_json::to_value(e).unwrap(), json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{}"}}));
        assert_eq!(serde_json::to_value(MessageStreamEvent::MessageStop).unwrap(), json!({"type": "message_stop"}));
        let err = AnthropicErrorResponse { kind: ErrorObject::Error, error: AnthropicErrorBody { kind: "not_found_error".into(), message: "m".into() } };
        assert_eq!(serde_json::to_value(err).unwrap(), json!({"type": "error", "error": {"type": "not_found_error", "message": "m"}}));
    }

    #[test]
    fn anthropic_rules_are_enforced() {
        let base = || MessagesRequest { model: "m".into(), max_tokens: 10, ..MessagesRequest::default() };
        assert!(MessagesRequest { temperature: Some(1.5), ..base() }.validate().is_err());
        assert!(MessagesRequest { max_tokens: 0, ..base() }.validate().is_err());
        assert!(MessagesRequest { stop_sequences: Some(vec!["".into()]), ..base() }.validate().is_err());
        let server_tool = AnthropicTool { name: "web_search".into(), description: None, input_schema: None, kind: Some("web_search_20250305".into()) };
        assert!(MessagesRequest { tools: Some(vec![server_tool]), ..base() }.validate().is_err());
        assert!(MessagesRequest { tool_choice: Some(AnthropicToolChoice::Tool { name: "x".into(), disable_parallel_tool_use: None }), ..base() }.validate().is_err());
    }
}
