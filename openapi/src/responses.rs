//! OpenAI's Responses API (`/v1/responses`): the request with its input items, the
//! response object with its output items, and the streaming events, in OpenAI's shapes (for
//! Codex CLI and the Agents SDK).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

use crate::generation::constant_tag;

constant_tag!(
    /// Always `"response"`.
    ResponseObjectTag::Response = "response"
);

/// `POST /v1/responses`. Unknown fields are ignored.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct ResponsesRequest {
    /// The model, as listed by `GET /v1/models` (or `""`).
    #[serde(default)]
    pub model: String,
    /// One user turn as a string, or input items.
    pub input: ResponsesInput,
    /// A system message before the input (not carried over by `previous_response_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    /// Tools: `function` tools, and the functions of `namespace` tools (Codex's sub-agent
    /// and MCP tools), are offered to the model; others (web search, shell, ...) are left
    /// out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<ResponsesTool>>,
    /// `none`, `auto`, `required`, or `{"type": "function", "name"}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<Value>,
    /// At most one function call per turn when false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    /// `text.format`: `text`, `json_object` or `json_schema` (enforced by grammar).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<TextConfig>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1)]
    pub max_output_tokens: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.0, maximum = 2.0)]
    pub temperature: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.0, maximum = 1.0)]
    pub top_p: Option<f32>,
    /// `reasoning.effort`, for templates that read `reasoning_effort`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<ReasoningConfig>,
    /// Keep the response for `GET` and `previous_response_id` (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<bool>,
    /// Continue the conversation of a stored response.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_response_id: Option<String>,
    #[serde(default)]
    #[schema(default = false)]
    pub stream: bool,
    /// Refused when true: responses are not run in the background.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub background: Option<bool>,
}

/// The input: a string, or items.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum ResponsesInput {
    Text(String),
    Items(Vec<InputItemParam>),
}

impl Default for ResponsesInput {
    fn default() -> Self {
        ResponsesInput::Text(String::new())
    }
}

/// An input item: typed, or a message without `type` (`{"role", "content"}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum InputItemParam {
    Typed(InputItem),
    Message(EasyMessage),
}

/// A message given without `type`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct EasyMessage {
    /// `user`, `system`, `developer` or `assistant`.
    pub role: String,
    pub content: MessageInput,
}

/// A typed input item.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum InputItem {
    Message {
        role: String,
        content: MessageInput,
    },
    /// A function call the model made earlier.
    FunctionCall {
        call_id: String,
        name: String,
        /// The namespace tool the function belongs to, as the call came back.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        namespace: Option<String>,
        /// The arguments as JSON text.
        arguments: String,
    },
    /// What a function call gave back.
    FunctionCallOutput {
        call_id: String,
        output: FunctionOutput,
    },
    /// Reasoning the model did earlier.
    Reasoning {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        content: Option<Vec<ReasoningText>>,
        #[serde(default)]
        summary: Vec<SummaryText>,
    },
    /// Refused: hearth keeps whole responses, not items, by id.
    ItemReference { id: String },
}

/// A message's content: a string or parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum MessageInput {
    Text(String),
    Parts(Vec<InputPart>),
}

/// A part of a message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum InputPart {
    InputText { text: String },
    /// An earlier answer's text.
    OutputText { text: String },
    Refusal { refusal: String },
    /// Refused (400): the model reads text only.
    InputImage {},
    /// Refused (400).
    InputFile {},
}

/// A function's output: text or parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum FunctionOutput {
    Text(String),
    Parts(Vec<InputPart>),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ReasoningText {
    /// `reasoning_text`.
    #[serde(rename = "type")]
    pub kind: String,
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SummaryText {
    /// `summary_text`.
    #[serde(rename = "type")]
    pub kind: String,
    pub text: String,
}

/// A tool: a function (flat, no `function` wrapper), a `namespace` holding functions in
/// `tools`, or another kind hearth leaves out.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ResponsesTool {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Object)]
    pub parameters: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
    /// A `namespace` tool's functions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(no_recursion)]
    pub tools: Option<Vec<ResponsesTool>>,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct TextConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<TextFormat>,
}

/// The answer's format.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TextFormat {
    Text,
    JsonObject,
    JsonSchema {
        #[serde(default)]
        name: String,
        #[schema(value_type = Object)]
        schema: Value,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        description: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        strict: Option<bool>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
pub struct ReasoningConfig {
    /// `none`, `minimal`, `low`, `medium`, `high` (`xhigh` reads as high).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub effort: Option<String>,
}

/// A response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ResponseObject {
    /// `resp_...`.
    pub id: String,
    pub object: ResponseObjectTag,
    pub created_at: u64,
    /// `in_progress`, `completed`, `incomplete` or `failed`.
    pub status: String,
    pub model: String,
    pub error: Option<Value>,
    pub incomplete_details: Option<IncompleteDetails>,
    pub instructions: Option<String>,
    pub output: Vec<OutputItem>,
    pub parallel_tool_calls: bool,
    pub tool_choice: Value,
    #[schema(value_type = Vec<Object>)]
    pub tools: Vec<Value>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub max_output_tokens: Option<u32>,
    pub previous_response_id: Option<String>,
    pub store: bool,
    pub text: Value,
    pub usage: Option<ResponseUsage>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct IncompleteDetails {
    /// `max_output_tokens`.
    pub reason: String,
}

/// An output item.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    Message { id: String, role: String, status: String, content: Vec<OutputText> },
    FunctionCall {
        id: String,
        call_id: String,
        /// The function's own name (inside its namespace, if any).
        name: String,
        /// The `namespace` tool the function came in, if it did: Codex finds its handler by
        /// namespace and name.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        namespace: Option<String>,
        arguments: String,
        status: String,
    },
    Reasoning { id: String, summary: Vec<SummaryText>, content: Vec<ReasoningText>, status: String },
}

/// The text of an answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OutputText {
    /// `output_text`.
    #[serde(rename = "type")]
    pub kind: String,
    pub text: String,
    #[schema(value_type = Vec<Object>)]
    pub annotations: Vec<Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ResponseUsage {
    pub input_tokens: u32,
    pub input_tokens_details: CachedTokens,
    pub output_tokens: u32,
    pub output_tokens_details: ReasoningTokens,
    pub total_tokens: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct CachedTokens {
    pub cached_tokens: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ReasoningTokens {
    pub reasoning_tokens: u32,
}

/// `DELETE /v1/responses/{id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ResponseDeleted {
    pub id: String,
    pub object: ResponseObjectTag,
    pub deleted: bool,
}

/// One streamed event; every one carries its `sequence_number`, from 0.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ResponseStreamFrame {
    #[serde(flatten)]
    pub event: ResponseStreamEvent,
    pub sequence_number: u64,
}

/// The events of a streamed response, named by `type`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type")]
pub enum ResponseStreamEvent {
    #[serde(rename = "response.created")]
    Created { response: Box<ResponseObject> },
    #[serde(rename = "response.in_progress")]
    InProgress { response: Box<ResponseObject> },
    #[serde(rename = "response.output_item.added")]
    OutputItemAdded { output_index: u32, item: OutputItem },
    #[serde(rename = "response.output_item.done")]
    OutputItemDone { output_index: u32, item: OutputItem },
    #[serde(rename = "response.content_part.added")]
    ContentPartAdded { item_id: String, output_index: u32, content_index: u32, part: OutputText },
    #[serde(rename = "response.content_part.done")]
    ContentPartDone { item_id: String, output_index: u32, content_index: u32, part: OutputText },
    #[serde(rename = "response.output_text.delta")]
    OutputTextDelta {
        item_id: String,
        output_index: u32,
        content_index: u32,
        delta: String,
        #[schema(value_type = Vec<Object>)]
        logprobs: Vec<Value>,
    },
    #[serde(rename = "response.output_text.done")]
    OutputTextDone {
        item_id: String,
        output_index: u32,
        content_index: u32,
        text: String,
        #[schema(value_type = Vec<Object>)]
        logprobs: Vec<Value>,
    },
    #[serde(rename = "response.reasoning_text.delta")]
    ReasoningTextDelta { item_id: String, output_index: u32, content_index: u32, delta: String },
    #[serde(rename = "response.reasoning_text.done")]
    ReasoningTextDone { item_id: String, output_index: u32, content_index: u32, text: String },
    #[serde(rename = "response.function_call_arguments.delta")]
    FunctionCallArgumentsDelta { item_id: String, output_index: u32, delta: String },
    #[serde(rename = "response.function_call_arguments.done")]
    FunctionCallArgumentsDone { item_id: String, output_index: u32, name: String, arguments: String },
    #[serde(rename = "response.completed")]
    Completed { response: Box<ResponseObject> },
    #[serde(rename = "response.incomplete")]
    Incomplete { response: Box<ResponseObject> },
    #[serde(rename = "response.failed")]
    Failed { response: Box<ResponseObject> },
}
