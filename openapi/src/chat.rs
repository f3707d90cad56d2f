//! `POST /v1/chat/completions`: the request, its messages and tools, the response, and the
//! stream chunks, in OpenAI's shapes.
//!
//! Response fields OpenAI always sends, even as `null` (`logprobs`, `finish_reason` of a
//! chunk, a tool-calling message's `content`), are `Option`s without `skip_serializing_if`
//! and `required` in the schema; the ones it leaves out when unset are skipped.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::generation::{constant_tag, present_or_null, FinishReason, Stop, StreamOptions, Usage};

constant_tag!(
    /// Always `"chat.completion"`.
    ChatCompletionObject::ChatCompletion = "chat.completion"
);
constant_tag!(
    /// Always `"chat.completion.chunk"`.
    ChatCompletionChunkObject::ChatCompletionChunk = "chat.completion.chunk"
);
constant_tag!(
    /// Always `"assistant"`: the role of every message hearth generates.
    AssistantRole::Assistant = "assistant"
);
constant_tag!(
    /// Always `"function"`, the only kind of tool.
    ToolType::Function = "function"
);

with_sampling_fields! {
/// A chat completion request. Fields hearth does not know are ignored, as OpenAI does.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct ChatCompletionRequest {
    /// The model to use, as listed by `GET /v1/models`.
    #[schema(example = "SmolLM2-135M-Instruct")]
    pub model: String,
    /// The conversation so far, oldest first.
    #[schema(min_items = 1)]
    pub messages: Vec<ChatMessage>,
    /// Stream the answer as server-sent events (`chat.completion.chunk` objects, then
    /// `data: [DONE]`).
    #[serde(default)]
    #[schema(default = false)]
    pub stream: bool,
    /// Options for streaming; only read when `stream` is true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    /// The most tokens to generate per choice (deprecated by OpenAI in favour of
    /// `max_completion_tokens`, which wins when both are set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1)]
    pub max_tokens: Option<u32>,
    /// The most tokens to generate per choice; without it, until the model stops or the
    /// context is full.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1)]
    pub max_completion_tokens: Option<u32>,
    /// Seed of the sampler, for repeatable answers on the same model and settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    /// Up to 4 sequences that end generation; they are not included in the output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Stop>,
    /// Return the log-probability of each generated token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<bool>,
    /// With `logprobs`, also return this many most likely alternatives at each position.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0, maximum = 20)]
    pub top_logprobs: Option<u32>,
    /// How many choices to generate for the prompt. Default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1)]
    pub n: Option<u32>,
    /// Constrain the output format: plain text, any JSON object, or JSON valid against a
    /// schema. JSON output is enforced by grammar-constrained sampling, so it always parses.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<ResponseFormat>,
    /// Functions the model may call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<Tool>>,
    /// Whether the model may (`auto`), must not (`none`), or must (`required`, or a named
    /// function) call a tool. Default `auto` when `tools` are given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<ToolChoice>,
    /// Whether the model may call several tools in one turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    /// An id of the end user, recorded in logs only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// How much a reasoning model should think before answering. Given to the model's chat
    /// template as `reasoning_effort` (gpt-oss's template writes it into its system
    /// message); a template that does not read it ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_effort: Option<ReasoningEffort>,
    /// Extra variables for the model's chat template (as llama-server and vLLM take them),
    /// e.g. `{"enable_thinking": false}` for Qwen3. Values are booleans or numbers:
    /// templates print these outside the marked message text, where a string could forge
    /// control tokens. Names are identifiers other than the template's own variables.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_kwargs: Option<BTreeMap<String, TemplateArg>>,
}
}

/// `reasoning_effort`: OpenAI's levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ReasoningEffort {
    None,
    Minimal,
    Low,
    Medium,
    High,
}

impl ReasoningEffort {
    pub fn as_str(self) -> &'static str {
        match self {
            ReasoningEffort::None => "none",
            ReasoningEffort::Minimal => "minimal",
            ReasoningEffort::Low => "low",
            ReasoningEffort::Medium => "medium",
            ReasoningEffort::High => "high",
        }
    }
}

/// A value of `chat_template_kwargs`: a boolean or a number.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged, expecting = "a boolean or a number (strings are not taken: a template prints them outside the marked message text)")]
pub enum TemplateArg {
    Bool(bool),
    Int(i64),
    Float(f64),
}

impl TemplateArg {
    pub fn to_json(self) -> serde_json::Value {
        match self {
            TemplateArg::Bool(b) => b.into(),
            TemplateArg::Int(i) => i.into(),
            TemplateArg::Float(f) => serde_json::Number::from_f64(f).map_or(serde_json::Value::Null, serde_json::Value::Number),
        }
    }
}

/// Variables the chat template gets from hearth itself; `chat_template_kwargs` may not
/// replace them.
pub const RESERVED_TEMPLATE_VARIABLES: [&str; 6] = ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "reasoning_effort"];

impl ChatCompletionRequest {
    /// The token limit per choice: `max_completion_tokens`, else `max_tokens`; `None` means
    /// until the model stops or the context is full.
    pub fn max_new_tokens(&self) -> Option<u32> {
        self.max_completion_tokens.or(self.max_tokens)
    }

    /// Choices to generate (`n`, default 1).
    pub fn choices(&self) -> u32 {
        self.n.unwrap_or(1)
    }

    /// Whether a streamed response must end with a usage chunk.
    pub fn include_usage(&self) -> bool {
        self.stream && self.stream_options.is_some_and(|o| o.include_usage)
    }

    /// The stop sequences, empty when none were given.
    pub fn stop_sequences(&self) -> Vec<String> {
        self.stop.as_ref().map(Stop::to_vec).unwrap_or_default()
    }

    /// The variables this request adds to the chat template: `reasoning_effort` and the
    /// `chat_template_kwargs` (validated: `validate`).
    pub fn template_variables(&self) -> BTreeMap<String, serde_json::Value> {
        let mut vars: BTreeMap<String, serde_json::Value> = self.chat_template_kwargs.iter().flatten().map(|(k, v)| (k.clone(), v.to_json())).collect();
        if let Some(e) = self.reasoning_effort {
            vars.insert("reasoning_effort".into(), e.as_str().into());
        }
        vars
    }

    /// Alternatives per position to report: `Some(top_logprobs or 0)` when `logprobs` is
    /// true, `None` when no logprobs were asked for.
    pub fn logprobs_requested(&self) -> Option<u32> {
        (self.logprobs == Some(true)).then(|| self.top_logprobs.unwrap_or(0))
    }
}

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Instructions to the model.
    System,
    /// Instructions to the model (OpenAI's newer name for `system`; treated the same).
    Developer,
    /// The person talking to the model.
    User,
    /// The model.
    Assistant,
    /// The result of a tool call, answering the call named by `tool_call_id`.
    Tool,
    /// OpenAI's deprecated function result role; refused, use `tool`.
    Function,
}

impl Role {
    /// The role's name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::Developer => "developer",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
            Role::Function => "function",
        }
    }

    /// The role to give a chat template: chat templates predate `developer` and only know
    /// `system`, which is what OpenAI treats it as.
    pub fn template_role(self) -> &'static str {
        match self {
            Role::Developer => "system",
            other => other.as_str(),
        }
    }
}

/// One message of the conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ChatMessage {
    /// Who wrote the message.
    pub role: Role,
    /// The text, as a string or an array of content parts; may be null on an assistant
    /// message that only calls tools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<MessageContent>,
    /// An optional name of the author, to tell participants with the same role apart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// On an assistant message: the tool calls it made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// On a tool message: the id of the tool call this message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// On an assistant message: its thinking, as hearth returned it; handed to templates
    /// that render earlier thinking (hearth extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    /// A plain text message.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        ChatMessage {
            role,
            content: Some(MessageContent::Text(content.into())),
            name: None,
            tool_calls: None,
            tool_call_id: None,
            reasoning_content: None,
        }
    }

    /// The message's text (text parts joined), empty when it has none.
    pub fn text(&self) -> String {
        self.content
            .as_ref()
            .map(MessageContent::text)
            .unwrap_or_default()
    }
}

/// A message's content: a string, or an array of parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    /// The text itself.
    Text(String),
    /// Content parts; hearth's models read text only, so other part types are refused.
    Parts(Vec<ContentPart>),
}

impl MessageContent {
    /// The text: the string itself, or the text parts joined by newlines (as vLLM does),
    /// since parts sent separately are separate blocks to the writer.
    pub fn text(&self) -> String {
        match self {
            MessageContent::Text(text) => text.clone(),
            MessageContent::Parts(parts) => parts
                .iter()
                .filter_map(|part| match part {
                    ContentPart::Text { text } => Some(text.as_str()),
                    _ => None,
                })
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }
}

/// One part of a message's content. Parts other than `text` are accepted so that the
/// request parses, and then refused by validation with a message naming the part.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    /// Text.
    Text {
        /// The text.
        text: String,
    },
    /// An image (not supported: hearth's models read text only).
    ImageUrl {
        /// The image's URL or data URL, with its detail level.
        #[serde(default)]
        image_url: serde_json::Value,
    },
    /// Audio input (not supported).
    InputAudio {
        /// The audio data and its format.
        #[serde(default)]
        input_audio: serde_json::Value,
    },
    /// A file (not supported).
    File {
        /// The file's id or data.
        #[serde(default)]
        file: serde_json::Value,
    },
    // Any other part type lands here rather than failing the whole request with serde's
    // opaque untagged-enum error; it is never sent, so it is not in the schema.
    #[serde(other, skip_serializing)]
    Other,
}

impl ContentPart {
    /// The part's `type` as the client spelled it, where known.
    pub fn type_name(&self) -> Option<&'static str> {
        match self {
            ContentPart::Text { .. } => Some("text"),
            ContentPart::ImageUrl { .. } => Some("image_url"),
            ContentPart::InputAudio { .. } => Some("input_audio"),
            ContentPart::File { .. } => Some("file"),
            ContentPart::Other => None,
        }
    }
}

/// A function the model may call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Tool {
    /// Always `function`.
    #[serde(rename = "type", default)]
    pub kind: ToolType,
    /// The function.
    pub function: FunctionDefinition,
}

/// A function's name, purpose and parameters, shown to the model through the chat template.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FunctionDefinition {
    /// The function's name: letters, digits, `_` and `-`, at most 64 characters.
    pub name: String,
    /// What the function does, for the model to decide when to call it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The function's parameters as a JSON Schema object; omitted means no parameters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<serde_json::Value>,
    /// Whether the arguments must follow `parameters` exactly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// A tool call made by the assistant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ToolCall {
    /// The call's id, which the tool message answering it repeats in `tool_call_id`.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type", default)]
    pub kind: ToolType,
    /// The function called and its arguments.
    pub function: FunctionCall,
}

/// A function called by the assistant.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct FunctionCall {
    /// The function's name.
    pub name: String,
    /// The arguments as a JSON-encoded object (a string, as in OpenAI's API; an object is
    /// accepted too and re-encoded, as some non-OpenAI clients send one).
    #[serde(deserialize_with = "string_or_json")]
    pub arguments: String,
}

fn string_or_json<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<String, D::Error> {
    match serde_json::Value::deserialize(deserializer)? {
        serde_json::Value::String(text) => Ok(text),
        other => Ok(other.to_string()),
    }
}

/// Whether and which tool the model must call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum ToolChoice {
    /// `none`, `auto` or `required`.
    Mode(ToolChoiceMode),
    /// Call this function.
    Function(NamedToolChoice),
}

/// Whether the model may call tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ToolChoiceMode {
    /// Do not call tools; answer in text.
    None,
    /// Call tools or answer in text, as the model decides.
    Auto,
    /// Call at least one tool.
    Required,
}

/// A tool choice that forces one function.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct NamedToolChoice {
    /// Always `function`.
    #[serde(rename = "type", default)]
    pub kind: ToolType,
    /// The function to call.
    pub function: FunctionName,
}

/// Names a function.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct FunctionName {
    /// The function's name, as defined in `tools`.
    pub name: String,
}

/// The format the answer must have.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    /// Free text (the default).
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON valid against the given schema.
    JsonSchema {
        /// The schema and its name.
        json_schema: JsonSchemaFormat,
    },
}

/// A named JSON Schema for `response_format`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct JsonSchemaFormat {
    /// The schema's name (OpenAI requires it; hearth only echoes it in logs).
    #[serde(default)]
    pub name: String,
    /// What the output is for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The JSON Schema object the output must validate against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<serde_json::Value>,
    /// Whether to follow the schema exactly; hearth always does, as its sampling is
    /// constrained by the schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// A chat completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ChatCompletionResponse {
    /// A unique id of the completion (`chatcmpl-...`).
    pub id: String,
    /// Always `chat.completion`.
    pub object: ChatCompletionObject,
    /// When the completion was created, in Unix seconds.
    pub created: u64,
    /// The model that generated it.
    pub model: String,
    /// The generated choices, one per `n`.
    pub choices: Vec<ChatChoice>,
    /// Token counts of the request.
    pub usage: Usage,
    /// Identifies the model file and server build that generated it, for reproducibility
    /// with `seed`.
    pub system_fingerprint: String,
}

/// One generated answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ChatChoice {
    /// The choice's position among `n`.
    pub index: u32,
    /// The generated message.
    pub message: AssistantMessage,
    /// Log-probabilities of the generated tokens; null unless `logprobs` was true.
    #[schema(required = true)]
    pub logprobs: Option<ChoiceLogprobs>,
    /// Why generation stopped.
    pub finish_reason: FinishReason,
}

/// A message generated by the model.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
pub struct AssistantMessage {
    /// Always `assistant`.
    pub role: AssistantRole,
    /// The text; null when the message only calls tools.
    #[schema(required = true)]
    pub content: Option<String>,
    /// The model's thinking before its answer, for reasoning models (`<think>` blocks;
    /// gpt-oss's analysis channel); absent when it wrote none (hearth extension, as
    /// llama-server and vLLM return it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The tools the model called, parsed from its output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

/// Log-probabilities of a choice's tokens, in OpenAI's chat shape.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct ChoiceLogprobs {
    /// One entry per generated content token.
    #[schema(required = true)]
    pub content: Option<Vec<TokenLogprob>>,
    /// Log-probabilities of refusal tokens; always null, hearth has no refusals.
    #[schema(required = true)]
    pub refusal: Option<Vec<TokenLogprob>>,
}

/// A generated token and its log-probability.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TokenLogprob {
    /// The token's text (lossy when the token is part of a multi-byte character).
    pub token: String,
    /// Its log-probability (never below -9999).
    pub logprob: f32,
    /// The token's exact UTF-8 bytes, for tokens that split a character.
    #[schema(required = true)]
    pub bytes: Option<Vec<u8>>,
    /// The most likely tokens at this position, most likely first (`top_logprobs` of them).
    pub top_logprobs: Vec<TopLogprob>,
}

/// A likely token at one position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TopLogprob {
    /// The token's text.
    pub token: String,
    /// Its log-probability (never below -9999).
    pub logprob: f32,
    /// The token's exact UTF-8 bytes.
    #[schema(required = true)]
    pub bytes: Option<Vec<u8>>,
}

/// One server-sent event of a streamed chat completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ChatCompletionChunk {
    /// The completion's id, the same in every chunk.
    pub id: String,
    /// Always `chat.completion.chunk`.
    pub object: ChatCompletionChunkObject,
    /// When the completion was created, in Unix seconds, the same in every chunk.
    pub created: u64,
    /// The model that generates it.
    pub model: String,
    /// Identifies the model file and server build.
    pub system_fingerprint: String,
    /// What this chunk adds to each choice; empty in the final usage chunk.
    pub choices: Vec<ChunkChoice>,
    /// Absent unless `stream_options.include_usage`; then null in every chunk except the
    /// last, which carries the request's usage. (Rust: `None` omits the field, `Some(None)`
    /// writes `null`.)
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "present_or_null"
    )]
    #[schema(value_type = Option<Usage>)]
    pub usage: Option<Option<Usage>>,
}

/// What one chunk adds to one choice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ChunkChoice {
    /// The choice's position among `n`.
    pub index: u32,
    /// The new part of the message.
    pub delta: Delta,
    /// Log-probabilities of the tokens in this delta; null unless `logprobs` was true.
    #[schema(required = true)]
    pub logprobs: Option<ChoiceLogprobs>,
    /// Null until the choice's last chunk, which says why it stopped.
    #[schema(required = true)]
    pub finish_reason: Option<FinishReason>,
}

/// A piece of the generated message.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
pub struct Delta {
    /// `assistant`, in the first chunk of each choice only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<AssistantRole>,
    /// New text, cut on UTF-8 character boundaries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// New thinking text of a reasoning model (see `AssistantMessage::reasoning_content`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// New pieces of tool calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// A piece of a tool call; the pieces with the same `index` make up one call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ToolCallDelta {
    /// Which of the choice's tool calls this piece belongs to.
    pub index: u32,
    /// The call's id, in its first piece.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function`, in its first piece.
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<ToolType>,
    /// The function's name and a piece of its arguments.
    pub function: FunctionCallDelta,
}

/// A piece of a function call.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
pub struct FunctionCallDelta {
    /// The function's name, in the call's first piece.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The next piece of the JSON-encoded arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn parse(value: Value) -> ChatCompletionRequest {
        serde_json::from_value(value).expect("request parses")
    }

    #[test]
    fn minimal_request_has_openai_defaults() {
        let req = parse(json!({
            "model": "m",
            "messages": [{"role": "user", "content": "Hi"}]
        }));
        assert!(!req.stream);
        assert_eq!(req.max_new_tokens(), None);
        assert_eq!(req.choices(), 1);
        assert!(!req.include_usage());
        assert!(req.stop_sequences().is_empty());
        assert_eq!(req.logprobs_requested(), None);
        assert_eq!(req.messages[0].text(), "Hi");
    }

    #[test]
    fn sdk_request_with_every_common_field_parses() {
        // The shape the OpenAI Python SDK sends, plus fields hearth does not know.
        let req = parse(json!({
            "model": "SmolLM2-135M-Instruct",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [
                    {"type": "text", "text": "What is the weather"},
                    {"type": "text", "text": "in Paris?"}
                ]},
                {"role": "assistant", "content": null, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}
                }]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"}
            ],
            "stream": true,
            "stream_options": {"include_usage": true},
            "max_tokens": 10,
            "max_completion_tokens": 20,
            "temperature": 0.7,
            "top_p": 0.9,
            "seed": 42,
            "stop": ["\n\n", "END"],
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "logit_bias": {"50256": -100},
            "logprobs": true,
            "top_logprobs": 3,
            "n": 2,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "weather", "strict": true,
                "schema": {"type": "object", "properties": {"t": {"type": "number"}}}
            }},
            "tools": [{"type": "function", "function": {
                "name": "get_weather", "description": "Weather of a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                "strict": false
            }}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": false,
            "user": "u-1",
            "top_k": 40, "min_p": 0.05, "repeat_penalty": 1.1,
            "store": false, "metadata": {"k": "v"}, "service_tier": "auto",
            "reasoning_effort": "low", "modalities": ["text"]
        }));
        assert_eq!(req.messages[0].role.template_role(), "system");
        assert_eq!(req.messages[1].text(), "What is the weather\nin Paris?");
        let calls = req.messages[2].tool_calls.as_ref().expect("tool calls");
        assert_eq!(calls[0].function.arguments, "{\"city\":\"Paris\"}");
        assert_eq!(req.messages[2].content, None);
        assert_eq!(req.messages[3].tool_call_id.as_deref(), Some("call_1"));
        assert!(req.include_usage());
        assert_eq!(req.max_new_tokens(), Some(20));
        assert_eq!(req.stop_sequences(), vec!["\n\n", "END"]);
        assert_eq!(req.logprobs_requested(), Some(3));
        assert_eq!(
            req.logit_bias.as_ref().and_then(|b| b.get("50256")),
            Some(&-100.0)
        );
        match &req.response_format {
            Some(ResponseFormat::JsonSchema { json_schema }) => {
                assert_eq!(json_schema.name, "weather");
                assert_eq!(
                    json_schema.schema.as_ref().map(|s| s["type"].clone()),
                    Some(json!("object"))
                );
            }
            other => panic!("unexpected response_format {other:?}"),
        }
        assert_eq!(
            req.tools.as_ref().map(|t| t[0].function.name.as_str()),
            Some("get_weather")
        );
        assert_eq!(
            req.tool_choice,
            Some(ToolChoice::Function(NamedToolChoice {
                kind: ToolType::Function,
                function: FunctionName {
                    name: "get_weather".into()
                },
            }))
        );
        assert_eq!(
            (req.top_k, req.min_p, req.repeat_penalty),
            (Some(40), Some(0.05), Some(1.1))
        );
    }

    #[test]
    fn stop_as_a_single_string() {
        let req = parse(json!({"model": "m", "messages": [], "stop": "###"}));
        assert_eq!(req.stop_sequences(), vec!["###"]);
    }

    #[test]
    fn tool_call_arguments_sent_as_an_object_are_re_encoded() {
        let call: ToolCall = serde_json::from_value(json!({
            "id": "c", "type": "function", "function": {"name": "f", "arguments": {"city": "Paris"}}
        }))
        .unwrap();
        assert_eq!(call.function.arguments, r#"{"city":"Paris"}"#);
    }

    #[test]
    fn parts_missing_their_payload_still_parse() {
        let part: ContentPart = serde_json::from_value(json!({"type": "image_url"})).unwrap();
        assert_eq!(part.type_name(), Some("image_url"));
    }

    #[test]
    fn tool_choice_modes_and_response_formats_parse() {
        for (mode, expected) in [
            ("none", ToolChoiceMode::None),
            ("auto", ToolChoiceMode::Auto),
            ("required", ToolChoiceMode::Required),
        ] {
            let choice: ToolChoice = serde_json::from_value(json!(mode)).unwrap();
            assert_eq!(choice, ToolChoice::Mode(expected));
        }
        let text: ResponseFormat = serde_json::from_value(json!({"type": "text"})).unwrap();
        assert_eq!(text, ResponseFormat::Text);
        let object: ResponseFormat =
            serde_json::from_value(json!({"type": "json_object"})).unwrap();
        assert_eq!(object, ResponseFormat::JsonObject);
        assert!(serde_json::from_value::<ToolChoice>(json!("sometimes")).is_err());
    }

    #[test]
    fn non_text_parts_parse_so_validation_can_name_them() {
        let req = parse(
            json!({"model": "m", "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
                {"type": "video_frames", "frames": []}
            ]}]}),
        );
        let Some(MessageContent::Parts(parts)) = &req.messages[0].content else {
            panic!("expected parts");
        };
        assert_eq!(parts[1].type_name(), Some("image_url"));
        assert_eq!(parts[2], ContentPart::Other);
        assert_eq!(req.messages[0].text(), "What is this?");
    }

    #[test]
    fn response_has_openai_shape_with_null_logprobs() {
        let response = ChatCompletionResponse {
            id: "chatcmpl-1".into(),
            object: ChatCompletionObject::ChatCompletion,
            created: 1_700_000_000,
            model: "m".into(),
            choices: vec![ChatChoice {
                index: 0,
                message: AssistantMessage {
                    content: Some("Hello!".into()),
                    ..Default::default()
                },
                logprobs: None,
                finish_reason: FinishReason::Stop,
            }],
            usage: Usage::new(9, 3),
            system_fingerprint: "fp_hearth".into(),
        };
        assert_eq!(
            serde_json::to_value(&response).unwrap(),
            json!({
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 1_700_000_000,
                "model": "m",
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": "Hello!"},
                    "logprobs": null,
                    "finish_reason": "stop"
                }],
                "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12},
                "system_fingerprint": "fp_hearth"
            })
        );
        let back: ChatCompletionResponse = serde_json::from_value(json!(response)).unwrap();
        assert_eq!(back, response);
    }

    #[test]
    fn tool_call_message_has_null_content() {
        let message = AssistantMessage {
            role: AssistantRole::Assistant,
            content: None,
            reasoning_content: None,
            tool_calls: Some(vec![ToolCall {
                id: "call_abc".into(),
                kind: ToolType::Function,
                function: FunctionCall {
                    name: "f".into(),
                    arguments: "{}".into(),
                },
            }]),
        };
        assert_eq!(
            json!(message),
            json!({
                "role": "assistant",
                "content": null,
                "tool_calls": [{"id": "call_abc", "type": "function",
                                "function": {"name": "f", "arguments": "{}"}}]
            })
        );
    }

    #[test]
    fn logprobs_have_openai_chat_shape() {
        let logprobs = ChoiceLogprobs {
            content: Some(vec![TokenLogprob {
                token: "Hi".into(),
                logprob: -0.5,
                bytes: Some(vec![72, 105]),
                top_logprobs: vec![TopLogprob {
                    token: "Hi".into(),
                    logprob: -0.5,
                    bytes: Some(vec![72, 105]),
                }],
            }]),
            refusal: None,
        };
        assert_eq!(
            json!(logprobs),
            json!({
                "content": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105],
                             "top_logprobs": [{"token": "Hi", "logprob": -0.5, "bytes": [72, 105]}]}],
                "refusal": null
            })
        );
    }

    fn chunk(choices: Vec<ChunkChoice>, usage: Option<Option<Usage>>) -> ChatCompletionChunk {
        ChatCompletionChunk {
            id: "chatcmpl-1".into(),
            object: ChatCompletionChunkObject::ChatCompletionChunk,
            created: 1,
            model: "m".into(),
            system_fingerprint: "fp".into(),
            choices,
            usage,
        }
    }

    #[test]
    fn chunks_have_openai_shape_and_usage_is_absent_null_or_set() {
        let first = ChunkChoice {
            index: 0,
            delta: Delta {
                role: Some(AssistantRole::Assistant),
                content: Some(String::new()),
                reasoning_content: None,
                tool_calls: None,
            },
            logprobs: None,
            finish_reason: None,
        };
        let last = ChunkChoice {
            index: 0,
            delta: Delta::default(),
            logprobs: None,
            finish_reason: Some(FinishReason::Length),
        };
        let header = json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                            "model": "m", "system_fingerprint": "fp"});
        let with = |extra: Value| {
            let mut v = header.clone();
            v.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            v
        };

        // Without include_usage the field is omitted.
        assert_eq!(
            json!(chunk(vec![first.clone()], None)),
            with(
                json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": null, "finish_reason": null}]})
            )
        );
        // With include_usage every chunk says null, and a last one carries the numbers.
        assert_eq!(
            json!(chunk(vec![last], Some(None))),
            with(
                json!({"choices": [{"index": 0, "delta": {}, "logprobs": null, "finish_reason": "length"}],
                        "usage": null})
            )
        );
        assert_eq!(
            json!(chunk(vec![], Some(Some(Usage::new(3, 4))))),
            with(json!({"choices": [],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}))
        );

        // And the three states survive a round trip, as a client reading the stream sees them.
        for usage in [None, Some(None), Some(Some(Usage::new(1, 2)))] {
            let c = chunk(vec![first.clone()], usage);
            let back: ChatCompletionChunk =
                serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
            assert_eq!(back, c);
        }
    }

    #[test]
    fn tool_call_deltas_have_openai_shape() {
        let delta = Delta {
            role: None,
            content: None,
            reasoning_content: None,
            tool_calls: Some(vec![ToolCallDelta {
                index: 0,
                id: Some("call_1".into()),
                kind: Some(ToolType::Function),
                function: FunctionCallDelta {
                    name: Some("f".into()),
                    arguments: Some("{\"a\"".into()),
                },
            }]),
        };
        assert_eq!(
            json!(delta),
            json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                   "function": {"name": "f", "arguments": "{\"a\""}}]})
        );
        let later = ToolCallDelta {
            index: 0,
            id: None,
            kind: None,
            function: FunctionCallDelta {
                name: None,
                arguments: Some(":1}".into()),
            },
        };
        assert_eq!(
            json!(later),
            json!({"index": 0, "function": {"arguments": ":1}"}})
        );
    }
}
