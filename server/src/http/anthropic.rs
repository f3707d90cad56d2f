//! Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`, for
//! Claude Code and every program built on the `anthropic` SDK.
//!
//! A Messages request is turned into a chat request and prepared as chat's are (template,
//! tools, grammar, limits); the answer is the same turn (`turn`) in Anthropic's blocks and
//! events. Errors go out in Anthropic's envelope (the route group's `Dialect`).

use std::sync::Arc;

use axum::extract::State;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use openapi::{
    AnthropicAssistantRole, AnthropicRole, Effort, JsonSchemaFormat, ReasoningEffort, ResponseFormat, AnthropicToolChoice, AnthropicUsage, BlockDelta, ChatCompletionRequest, ChatMessage, CountTokensRequest, CountTokensResponse, FunctionCall, FunctionDefinition, FunctionName, InputBlock,
    InputContent, MessageContent, MessageDeltaBody, MessageDeltaUsage, MessageStreamEvent, MessagesRequest, MessagesResponse, NamedToolChoice, OutputBlock, Role, StopReason, TemplateArg, ThinkingConfig, Tool, ToolCall,
    ToolChoice, ToolChoiceMode, ToolResultBlock, ToolResultContent, Usage,
};
use serde_json::Value;

use super::chat::{self, Input, THINKING_SWITCH};
use super::error::ApiError;
use super::generate::{self, GenSpec};
use super::json::ApiJson;
use super::prepare;
use super::reasoning::HarmonyCall;
use super::stream;
use super::tools::ToolUse;
use super::turn::{Answer, Piece, TurnStream};
use super::{check_model, AppState};
use crate::runtime::generation::Finish;

pub async fn messages(State(state): State<Arc<AppState>>, ApiJson(req): ApiJson<MessagesRequest>) -> Result<Response, ApiError> {
    generate::check_room(&state)?;
    let (req, prepared) = {
        let state = state.clone();
        prepare::run(move || {
            let (chat_req, prefill) = to_chat(&state, &req)?;
            chat::prepare(&state, &chat_req, Input::Chat { prefill: prefill.as_deref() }).map(|p| (req, p))
        })
        .await?
    };
    let id = format!("msg_{}", uuid::Uuid::new_v4().simple());
    let stops = req.stop_sequences.clone().unwrap_or_default();
    let spec = GenSpec {
        id: id.clone(),
        prompt: prepared.prompt,
        sampling: prepared.sampling,
        max_tokens: Some(req.max_tokens),
        stop: stops.clone(),
        logprobs: None,
        seed: None,
        prompt_field: "messages",
    };
    let receivers = generate::start(&state, &spec, 1)?;
    let reasoning = (state.reasoning, prepared.opens_thinking);
    let head = Head { id, model: req.model.clone(), prompt_tokens: spec.prompt.len(), stops };
    if req.stream {
        let events = MessageEvents { turn: TurnStream::new(reasoning), tool_use: prepared.tool_use, open: None, next_index: 0, end: None, head, cached: 0 };
        return Ok(stream::sse(receivers, spec.prompt.len(), events));
    }
    let choice = generate::collect_all(receivers).await?.pop().unwrap_or_default();
    let answer = Answer::of(choice.text, reasoning, prepared.tool_use.as_ref());
    let (stop_reason, stop_sequence) = head.stop_reason(choice.finish.unwrap_or(Finish::Stop), !answer.calls.is_empty());
    let mut content = Vec::new();
    if !answer.reasoning.is_empty() {
        content.push(OutputBlock::Thinking { thinking: answer.reasoning, signature: String::new() });
    }
    if !answer.text.is_empty() {
        content.push(OutputBlock::Text { text: answer.text });
    }
    content.extend(answer.calls.into_iter().map(tool_use_block));
    let usage = usage(head.prompt_tokens, choice.completion_tokens, choice.cached_tokens);
    Ok(Json(head.message(content, Some(stop_reason), stop_sequence, usage)).into_response())
}

pub async fn count_tokens(State(state): State<Arc<AppState>>, ApiJson(req): ApiJson<CountTokensRequest>) -> Result<Json<CountTokensResponse>, ApiError> {
    let req: MessagesRequest = req.into();
    let n = prepare::run(move || {
        let (chat_req, prefill) = to_chat(&state, &req)?;
        chat::prepare(&state, &chat_req, Input::Chat { prefill: prefill.as_deref() }).map(|p| p.prompt.len())
    })
    .await?;
    Ok(Json(CountTokensResponse { input_tokens: n as u32 }))
}

/// Clients built for Claude name Claude models (Claude Code's main and background models);
/// on this server any of them means the model it serves.
fn check_anthropic_model(state: &AppState, model: &str) -> Result<(), ApiError> {
    if model.starts_with("claude") {
        return Ok(());
    }
    check_model(state, model)
}

fn invalid(param: String, message: impl Into<String>) -> ApiError {
    ApiError::InvalidParameter { param: Some(param), message: message.into() }
}

fn no_images(param: String) -> ApiError {
    invalid(param, "images are not supported: the model this server runs reads text only")
}

/// The Messages request as a chat request, and the prefill (a last assistant turn) the
/// answer continues.
fn to_chat(state: &AppState, req: &MessagesRequest) -> Result<(ChatCompletionRequest, Option<String>), ApiError> {
    req.validate()?;
    check_anthropic_model(state, &req.model)?;
    if req.messages.is_empty() {
        return Err(invalid("messages".into(), "messages: at least one message is required"));
    }
    let mut messages: Vec<ChatMessage> = Vec::with_capacity(req.messages.len() + 1);
    if let Some(system) = &req.system {
        let text = system.text();
        if !text.is_empty() {
            messages.push(ChatMessage::new(Role::System, text));
        }
    }
    for (i, m) in req.messages.iter().enumerate() {
        match (m.role, &m.content) {
            (AnthropicRole::System, content) => push_system(&mut messages, system_turn_text(content, i)?),
            (role, InputContent::Text(text)) => push_text(&mut messages, role, text.clone()),
            (AnthropicRole::User, InputContent::Blocks(blocks)) => {
                // Tool results answer the previous assistant turn's calls, so they come
                // first, each a tool message; the turn's text follows as a user message.
                let mut text = Vec::new();
                for (j, b) in blocks.iter().enumerate() {
                    let at = || format!("messages[{i}].content[{j}]");
                    match b {
                        InputBlock::Text { text: t } => text.push(t.as_str()),
                        InputBlock::Image { .. } => return Err(no_images(at())),
                        InputBlock::ToolResult { tool_use_id, content, is_error } => {
                            let mut result = result_text(content.as_ref(), &at)?;
                            if *is_error == Some(true) {
                                result = format!("Error: {result}");
                            }
                            messages.push(ChatMessage { tool_call_id: Some(tool_use_id.clone()), ..ChatMessage::new(Role::Tool, result) });
                        }
                        InputBlock::ToolUse { .. } => return Err(invalid(at(), format!("{}: tool_use blocks belong in assistant turns", at()))),
                        InputBlock::Thinking { .. } | InputBlock::RedactedThinking { .. } => {}
                    }
                }
                if !text.is_empty() {
                    push_text(&mut messages, AnthropicRole::User, text.join("\n"));
                }
            }
            (AnthropicRole::Assistant, InputContent::Blocks(blocks)) => {
                let (mut text, mut thinking, mut calls) = (Vec::new(), Vec::new(), Vec::new());
                for (j, b) in blocks.iter().enumerate() {
                    let at = || format!("messages[{i}].content[{j}]");
                    match b {
                        InputBlock::Text { text: t } => text.push(t.as_str()),
                        InputBlock::Thinking { thinking: t, .. } => thinking.push(t.as_str()),
                        InputBlock::ToolUse { id, name, input } => {
                            calls.push(ToolCall { id: id.clone(), kind: Default::default(), function: FunctionCall { name: name.clone(), arguments: input.to_string() } })
                        }
                        InputBlock::RedactedThinking { .. } => {}
                        InputBlock::Image { .. } => return Err(no_images(at())),
                        InputBlock::ToolResult { .. } => return Err(invalid(at(), format!("{}: tool_result blocks belong in user turns", at()))),
                    }
                }
                let mut msg = ChatMessage::new(Role::Assistant, text.join("\n"));
                msg.reasoning_content = (!thinking.is_empty()).then(|| thinking.join("\n"));
                if calls.is_empty() && msg.reasoning_content.is_none() {
                    push_text(&mut messages, AnthropicRole::Assistant, msg.text());
                } else {
                    msg.tool_calls = (!calls.is_empty()).then_some(calls);
                    messages.push(msg);
                }
            }
        }
    }
    // A last assistant turn with text only is the start of the answer.
    let prefill = match messages.last() {
        Some(m) if m.role == Role::Assistant && m.tool_calls.is_none() && req.messages.last().is_some_and(|m| m.role == AnthropicRole::Assistant) => messages.pop().map(|m| m.text()),
        _ => None,
    };
    let tools: Option<Vec<Tool>> = req.tools.as_ref().map(|tools| {
        tools
            .iter()
            .map(|t| Tool { kind: Default::default(), function: FunctionDefinition { name: t.name.clone(), description: t.description.clone(), parameters: t.input_schema.clone(), strict: None } })
            .collect()
    });
    let tool_choice = req.tool_choice.as_ref().map(|c| match c {
        AnthropicToolChoice::Auto { .. } => ToolChoice::Mode(ToolChoiceMode::Auto),
        AnthropicToolChoice::Any { .. } => ToolChoice::Mode(ToolChoiceMode::Required),
        AnthropicToolChoice::None => ToolChoice::Mode(ToolChoiceMode::None),
        AnthropicToolChoice::Tool { name, .. } => ToolChoice::Function(NamedToolChoice { kind: Default::default(), function: FunctionName { name: name.clone() } }),
    });
    let thinking = match req.thinking {
        Some(ThinkingConfig::Enabled { .. }) => Some(true),
        Some(ThinkingConfig::Disabled) => Some(false),
        Some(ThinkingConfig::Adaptive | ThinkingConfig::Other) | None => None,
    };
    let output = req.output_config.clone().unwrap_or_default();
    let response_format = output.format.map(|f| ResponseFormat::JsonSchema { json_schema: JsonSchemaFormat { name: "output".into(), description: None, schema: Some(f.schema), strict: Some(true) } });
    let reasoning_effort = output.effort.map(|e| match e {
        Effort::Low => ReasoningEffort::Low,
        Effort::Medium => ReasoningEffort::Medium,
        Effort::High | Effort::Xhigh | Effort::Max => ReasoningEffort::High,
    });
    let chat_req = ChatCompletionRequest {
        // Checked above, aliases included.
        model: String::new(),
        messages,
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        tools,
        tool_choice,
        parallel_tool_calls: req.tool_choice.as_ref().is_some_and(AnthropicToolChoice::single).then_some(false),
        response_format,
        reasoning_effort,
        chat_template_kwargs: thinking.map(|on| [(THINKING_SWITCH.to_string(), TemplateArg::Bool(on))].into()),
        ..ChatCompletionRequest::default()
    };
    Ok((chat_req, prefill))
}

/// A system turn's text: a string or text blocks (Claude Code's billing header block, if
/// one comes here, is dropped as from `system`).
fn system_turn_text(content: &InputContent, i: usize) -> Result<String, ApiError> {
    let blocks = match content {
        InputContent::Text(t) => return Ok(if openapi::is_billing_header(t) { String::new() } else { t.clone() }),
        InputContent::Blocks(blocks) => blocks,
    };
    let mut text = Vec::with_capacity(blocks.len());
    for (j, b) in blocks.iter().enumerate() {
        match b {
            InputBlock::Text { text: t } if openapi::is_billing_header(t) => {}
            InputBlock::Text { text: t } => text.push(t.as_str()),
            _ => {
                let at = format!("messages[{i}].content[{j}]");
                return Err(invalid(at.clone(), format!("{at}: system turns hold text blocks only")));
            }
        }
    }
    Ok(text.join("\n\n"))
}

/// Adds a system turn of `messages`. Before the conversation's first user or assistant
/// turn it joins the system prompt, as the real API reads it. Later (Anthropic's
/// mid-conversation system messages, which follow a user turn) it stays where it is, in
/// that user turn: many chat templates refuse a system message anywhere but first, and
/// moving it up into the system prompt would change the prompt's start, so every earlier
/// turn would be computed again instead of coming from the cache.
fn push_system(messages: &mut Vec<ChatMessage>, text: String) {
    if text.is_empty() {
        return;
    }
    if messages.iter().all(|m| m.role == Role::System) {
        match messages.first_mut() {
            Some(first) => {
                let merged = format!("{}\n\n{text}", first.text());
                first.content = Some(MessageContent::Text(merged));
            }
            None => messages.push(ChatMessage::new(Role::System, text)),
        }
    } else {
        push_text(messages, AnthropicRole::User, text);
    }
}

/// Adds text as a turn of `role`, merged into the previous turn when that is a plain turn
/// of the same role (Anthropic allows consecutive turns of one role; templates do not).
fn push_text(messages: &mut Vec<ChatMessage>, role: AnthropicRole, text: String) {
    let role = match role {
        AnthropicRole::User => Role::User,
        AnthropicRole::Assistant => Role::Assistant,
        AnthropicRole::System => Role::System,
    };
    match messages.last_mut() {
        Some(last) if last.role == role && last.tool_calls.is_none() && last.reasoning_content.is_none() => {
            let merged = format!("{}\n\n{text}", last.text());
            last.content = Some(MessageContent::Text(merged));
        }
        _ => messages.push(ChatMessage::new(role, text)),
    }
}

/// A tool result's text.
fn result_text(content: Option<&ToolResultContent>, at: &dyn Fn() -> String) -> Result<String, ApiError> {
    Ok(match content {
        None => String::new(),
        Some(ToolResultContent::Text(t)) => t.clone(),
        Some(ToolResultContent::Blocks(blocks)) => {
            let mut parts = Vec::with_capacity(blocks.len());
            for b in blocks {
                match b {
                    ToolResultBlock::Text { text } => parts.push(text.as_str()),
                    ToolResultBlock::Image { .. } => return Err(no_images(format!("{}.content", at()))),
                }
            }
            parts.join("\n")
        }
    })
}

fn tool_use_block(call: HarmonyCall) -> OutputBlock {
    OutputBlock::ToolUse { id: new_tool_use_id(), name: call.name, input: tool_input(&call.arguments) }
}

fn new_tool_use_id() -> String {
    format!("toolu_{}", &uuid::Uuid::new_v4().simple().to_string()[..24])
}

/// A call's arguments as the object Anthropic's `input` is (the grammar makes them JSON;
/// anything else is an empty input rather than a block the SDK cannot read).
fn tool_input(arguments: &str) -> Value {
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => Value::Object(Default::default()),
    }
}

/// Prompt tokens split as Anthropic counts them: reused from the cache, and the rest.
fn usage(prompt_tokens: usize, output_tokens: usize, cached: usize) -> AnthropicUsage {
    AnthropicUsage { input_tokens: prompt_tokens.saturating_sub(cached) as u32, output_tokens: output_tokens as u32, cache_creation_input_tokens: 0, cache_read_input_tokens: cached as u32 }
}

/// What a message shares, whole or streamed.
struct Head {
    id: String,
    model: String,
    prompt_tokens: usize,
    stops: Vec<String>,
}

impl Head {
    fn message(&self, content: Vec<OutputBlock>, stop_reason: Option<StopReason>, stop_sequence: Option<String>, usage: AnthropicUsage) -> MessagesResponse {
        MessagesResponse { id: self.id.clone(), kind: Default::default(), role: AnthropicAssistantRole::Assistant, content, model: self.model.clone(), stop_reason, stop_sequence, usage }
    }

    fn stop_reason(&self, finish: Finish, called_tools: bool) -> (StopReason, Option<String>) {
        match finish {
            _ if called_tools => (StopReason::ToolUse, None),
            Finish::StopString(i) => (StopReason::StopSequence, self.stops.get(i).cloned()),
            Finish::Stop => (StopReason::EndTurn, None),
            Finish::Length => (StopReason::MaxTokens, None),
        }
    }
}

/// The kind of the content block being streamed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    Thinking,
    Text,
}

/// A streamed message: `message_start` (once the prompt is processed, with the usage's
/// cached split), each block's start, deltas and stop (block
/// indices are positions in the message's content), `message_delta` with the stop reason
/// and usage, `message_stop`. Tool calls are decided at the end of the turn, so each comes
/// as one whole `input_json_delta`.
struct MessageEvents {
    head: Head,
    /// Prompt tokens reused from the cache, known before `message_start`.
    cached: usize,
    turn: TurnStream,
    tool_use: Option<ToolUse>,
    open: Option<(u32, Open)>,
    next_index: u32,
    end: Option<(StopReason, Option<String>)>,
}

fn event(e: &MessageStreamEvent) -> SseEvent {
    stream::named(e)
}

impl MessageEvents {
    fn start_block(&mut self, block: OutputBlock, out: &mut Vec<SseEvent>) -> u32 {
        let index = self.next_index;
        self.next_index += 1;
        out.push(event(&MessageStreamEvent::ContentBlockStart { index, content_block: block }));
        index
    }

    fn close_open(&mut self, out: &mut Vec<SseEvent>) {
        if let Some((index, kind)) = self.open.take() {
            if kind == Open::Thinking {
                out.push(event(&MessageStreamEvent::ContentBlockDelta { index, delta: BlockDelta::SignatureDelta { signature: String::new() } }));
            }
            out.push(event(&MessageStreamEvent::ContentBlockStop { index }));
        }
    }

    fn pieces(&mut self, pieces: Vec<Piece>) -> Vec<SseEvent> {
        let mut out = Vec::new();
        for p in pieces {
            let (kind, delta) = match p {
                Piece::Reasoning(thinking) => (Open::Thinking, BlockDelta::ThinkingDelta { thinking }),
                Piece::Text(text) => (Open::Text, BlockDelta::TextDelta { text }),
            };
            let index = match self.open {
                Some((index, k)) if k == kind => index,
                _ => {
                    self.close_open(&mut out);
                    let block = match kind {
                        Open::Thinking => OutputBlock::Thinking { thinking: String::new(), signature: String::new() },
                        Open::Text => OutputBlock::Text { text: String::new() },
                    };
                    let index = self.start_block(block, &mut out);
                    self.open = Some((index, kind));
                    index
                }
            };
            out.push(event(&MessageStreamEvent::ContentBlockDelta { index, delta }));
        }
        out
    }
}

impl stream::Chunks for MessageEvents {
    type Frame = SseEvent;

    fn opens_after_start(&self) -> bool {
        true
    }

    fn cached(&mut self, cached_tokens: usize) {
        self.cached = cached_tokens;
    }

    fn opening(&mut self) -> Vec<SseEvent> {
        let usage = usage(self.head.prompt_tokens, 0, self.cached);
        vec![event(&MessageStreamEvent::MessageStart { message: self.head.message(Vec::new(), None, None, usage) }), event(&MessageStreamEvent::Ping)]
    }

    fn text(&mut self, _: usize, text: String, _: Option<crate::runtime::generation::TokenInfo>) -> Vec<SseEvent> {
        let pieces = self.turn.push(text, self.tool_use.as_ref());
        self.pieces(pieces)
    }

    fn finish(&mut self, _: usize, finish: Finish) -> Vec<SseEvent> {
        let (rest, calls) = self.turn.finish(self.tool_use.as_ref());
        let mut out = self.pieces(rest);
        self.close_open(&mut out);
        self.end = Some(self.head.stop_reason(finish, !calls.is_empty()));
        for call in calls {
            let input = tool_input(&call.arguments).to_string();
            let index = self.start_block(OutputBlock::ToolUse { id: new_tool_use_id(), name: call.name, input: Value::Object(Default::default()) }, &mut out);
            out.push(event(&MessageStreamEvent::ContentBlockDelta { index, delta: BlockDelta::InputJsonDelta { partial_json: input } }));
            out.push(event(&MessageStreamEvent::ContentBlockStop { index }));
        }
        out
    }

    fn done(&mut self, u: Usage) -> Vec<SseEvent> {
        let (stop_reason, stop_sequence) = self.end.take().unwrap_or((StopReason::EndTurn, None));
        let cached = u.prompt_tokens_details.map_or(0, |d| d.cached_tokens as usize);
        let a = usage(u.prompt_tokens as usize, u.completion_tokens as usize, cached);
        let usage = MessageDeltaUsage { output_tokens: a.output_tokens, input_tokens: a.input_tokens, cache_creation_input_tokens: 0, cache_read_input_tokens: a.cache_read_input_tokens };
        vec![event(&MessageStreamEvent::MessageDelta { delta: MessageDeltaBody { stop_reason: Some(stop_reason), stop_sequence }, usage }), event(&MessageStreamEvent::MessageStop)]
    }

    fn failure(&mut self, e: &ApiError) -> Vec<SseEvent> {
        vec![event(&MessageStreamEvent::Error { error: e.anthropic().1.error })]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_inputs_are_always_objects() {
        assert_eq!(tool_input("{\"a\": 1}"), serde_json::json!({"a": 1}));
        assert_eq!(tool_input("[1]"), serde_json::json!({}));
        assert_eq!(tool_input("not json"), serde_json::json!({}));
    }
}
