//! OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`, for
//! Codex CLI and the Agents SDK.
//!
//! The input items become a chat request prepared as chat's are; the answer is the shared
//! turn (`turn`) as output items (reasoning, message, function calls) and, streamed, as
//! Responses events with sequence numbers and output/content indices. Responses are kept
//! (`store`, the default) in a bounded store so `previous_response_id` can continue them.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use axum::extract::{Path, State};
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use openapi::{
    CachedTokens, ChatCompletionRequest, ChatMessage, FunctionCall, FunctionDefinition, FunctionName, FunctionOutput, IncompleteDetails, InputItem, InputItemParam, InputPart, JsonSchemaFormat, MessageInput,
    NamedToolChoice, OutputItem, OutputText, ReasoningEffort, ReasoningText, ResponseDeleted, ResponseObject, ResponseStreamEvent, ResponseStreamFrame, ResponseUsage, ResponsesInput, ResponsesRequest,
    ReasoningTokens, ResponseFormat, Role, TextFormat, Tool, ToolCall, ToolChoice, ToolChoiceMode, Usage,
};
use serde_json::{json, Value};

use super::chat::{self, Input};
use super::error::ApiError;
use super::generate::{self, GenSpec};
use super::json::ApiJson;
use super::prepare;
use super::reasoning::HarmonyCall;
use super::stream;
use super::tools::ToolUse;
use super::turn::{Answer, Piece, TurnStream};
use super::{check_model, AppState};
use crate::process::now_secs;
use crate::runtime::generation::{Finish, TokenInfo};

/// Responses kept at most; the oldest goes first.
pub const MAX_STORED_RESPONSES: usize = 1024;
/// Bytes the kept responses and their conversations may take (as JSON) at most; the
/// oldest go first. A long agent session keeps its latest turns.
pub const MAX_STORED_BYTES: usize = 64 << 20;

/// A kept response and the conversation it ended (its input, its output as chat turns),
/// which `previous_response_id` continues.
struct Stored {
    response: ResponseObject,
    conversation: Vec<ChatMessage>,
    bytes: usize,
}

/// The bounded store of responses, in memory (lost on restart).
#[derive(Default)]
pub struct ResponseStore {
    inner: Mutex<StoreInner>,
}

#[derive(Default)]
struct StoreInner {
    by_id: HashMap<String, Arc<Stored>>,
    /// Ids oldest first.
    order: VecDeque<String>,
    bytes: usize,
}

impl ResponseStore {
    fn put(&self, response: ResponseObject, conversation: Vec<ChatMessage>) {
        let bytes = serde_json::to_vec(&response).map_or(0, |v| v.len()) + serde_json::to_vec(&conversation).map_or(0, |v| v.len());
        if bytes > MAX_STORED_BYTES {
            return;
        }
        let mut s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        while s.by_id.len() >= MAX_STORED_RESPONSES || s.bytes + bytes > MAX_STORED_BYTES {
            let Some(old) = s.order.pop_front() else { break };
            if let Some(gone) = s.by_id.remove(&old) {
                s.bytes -= gone.bytes;
            }
        }
        s.bytes += bytes;
        s.order.push_back(response.id.clone());
        s.by_id.insert(response.id.clone(), Arc::new(Stored { response, conversation, bytes }));
    }

    fn get(&self, id: &str) -> Option<Arc<Stored>> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).by_id.get(id).cloned()
    }

    fn remove(&self, id: &str) -> bool {
        let mut s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        match s.by_id.remove(id) {
            Some(gone) => {
                s.bytes -= gone.bytes;
                s.order.retain(|x| x != id);
                true
            }
            None => false,
        }
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError::ResponseNotFound(id.into())
}

pub async fn retrieve(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<ResponseObject>, ApiError> {
    state.responses.get(&id).map(|s| Json(s.response.clone())).ok_or_else(|| not_found(&id))
}

pub async fn delete(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Result<Json<ResponseDeleted>, ApiError> {
    if state.responses.remove(&id) {
        Ok(Json(ResponseDeleted { id, object: Default::default(), deleted: true }))
    } else {
        Err(not_found(&id))
    }
}

fn invalid(param: impl Into<String>, message: impl Into<String>) -> ApiError {
    ApiError::InvalidParameter { param: Some(param.into()), message: message.into() }
}

fn new_id(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}

/// The text of message content, refusing what the model cannot read.
fn content_text(content: &MessageInput, at: &str) -> Result<String, ApiError> {
    match content {
        MessageInput::Text(t) => Ok(t.clone()),
        MessageInput::Parts(parts) => parts_text(parts, at),
    }
}

fn parts_text(parts: &[InputPart], at: &str) -> Result<String, ApiError> {
    let mut out = Vec::with_capacity(parts.len());
    for (j, p) in parts.iter().enumerate() {
        match p {
            InputPart::InputText { text } | InputPart::OutputText { text } => out.push(text.as_str()),
            InputPart::Refusal { refusal } => out.push(refusal.as_str()),
            InputPart::InputImage {} | InputPart::InputFile {} => return Err(invalid(format!("{at}[{j}]"), format!("{at}[{j}]: images and files are not supported: the model this server runs reads text only"))),
        }
    }
    Ok(out.join("\n"))
}

/// The functions offered to the model, by the name it calls them: every `function` tool,
/// and every function of a `namespace` tool (Codex sends its sub-agent and MCP tools so)
/// under its own name. Codex finds a call's handler by namespace and name, so a call of a
/// namespaced function goes back with its namespace (`split`). Where a name is taken
/// already, by a plain function or another namespace's, the later one is offered qualified
/// as Codex writes tool names: the namespace, then `__` unless it ends so, then the name.
#[derive(Default)]
struct Offered {
    tools: Vec<Tool>,
    /// Offered name → (namespace, function name), for namespaced functions only.
    namespaced: HashMap<String, (String, String)>,
}

/// The separator of a qualified name (Codex's MCP namespaces, `mcp__server__`, end in it).
const NAMESPACE_SEPARATOR: &str = "__";

impl Offered {
    fn of(req: &ResponsesRequest) -> Offered {
        let mut o = Offered::default();
        let mut taken: std::collections::HashSet<String> = req.tools.iter().flatten().filter(|t| t.kind == "function").filter_map(|t| t.name.clone()).collect();
        for t in req.tools.iter().flatten() {
            match t.kind.as_str() {
                "function" => o.tools.push(function_tool(t, t.name.clone().unwrap_or_default())),
                "namespace" => {
                    let namespace = t.name.clone().unwrap_or_default();
                    for f in t.tools.iter().flatten().filter(|f| f.kind == "function") {
                        let name = f.name.clone().unwrap_or_default();
                        let offered = if taken.contains(&name) {
                            let sep = if namespace.ends_with(NAMESPACE_SEPARATOR) { "" } else { NAMESPACE_SEPARATOR };
                            format!("{namespace}{sep}{name}")
                        } else {
                            name.clone()
                        };
                        taken.insert(offered.clone());
                        o.namespaced.insert(offered.clone(), (namespace.clone(), name));
                        o.tools.push(function_tool(f, offered));
                    }
                }
                _ => {}
            }
        }
        o
    }

    /// A call of the offered name as (function name, namespace).
    fn split(&self, offered: &str) -> (String, Option<String>) {
        match self.namespaced.get(offered) {
            Some((namespace, name)) => (name.clone(), Some(namespace.clone())),
            None => (offered.to_string(), None),
        }
    }

    /// The name a function (of a namespace, if given) was offered by.
    fn offered(&self, namespace: Option<&str>, name: &str) -> String {
        let Some(namespace) = namespace else { return name.to_string() };
        self.namespaced.iter().find(|(_, (ns, n))| ns == namespace && n == name).map_or_else(|| name.to_string(), |(offered, _)| offered.clone())
    }
}

fn function_tool(t: &openapi::ResponsesTool, name: String) -> Tool {
    Tool { kind: Default::default(), function: FunctionDefinition { name, description: t.description.clone(), parameters: t.parameters.clone(), strict: t.strict } }
}

/// The input items as chat turns, after the stored conversation they continue.
fn conversation(req: &ResponsesRequest, previous: Option<&Stored>, offered: &Offered) -> Result<Vec<ChatMessage>, ApiError> {
    let mut messages: Vec<ChatMessage> = previous.map(|p| p.conversation.clone()).unwrap_or_default();
    let items: Vec<InputItem> = match &req.input {
        ResponsesInput::Text(t) => vec![InputItem::Message { role: "user".into(), content: MessageInput::Text(t.clone()) }],
        ResponsesInput::Items(items) => items
            .iter()
            .map(|i| match i {
                InputItemParam::Typed(t) => t.clone(),
                InputItemParam::Message(m) => InputItem::Message { role: m.role.clone(), content: m.content.clone() },
            })
            .collect(),
    };
    // Reasoning items belong to the assistant turn that follows them.
    let mut reasoning: Vec<String> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        match item {
            InputItem::Message { role, content } => {
                let text = content_text(content, &format!("{at}.content"))?;
                let role = match role.as_str() {
                    "user" => Role::User,
                    "system" => Role::System,
                    "developer" => Role::Developer,
                    "assistant" => Role::Assistant,
                    other => return Err(invalid(format!("{at}.role"), format!("{at}.role: expected user, system, developer or assistant, got \"{other}\""))),
                };
                let mut m = ChatMessage::new(role, text);
                if role == Role::Assistant && !reasoning.is_empty() {
                    m.reasoning_content = Some(std::mem::take(&mut reasoning).join("\n"));
                }
                messages.push(m);
            }
            InputItem::FunctionCall { call_id, name, namespace, arguments } => {
                let name = offered.offered(namespace.as_deref(), name);
                let call = ToolCall { id: call_id.clone(), kind: Default::default(), function: FunctionCall { name, arguments: arguments.clone() } };
                // Calls of one turn are one assistant message.
                match messages.last_mut() {
                    Some(last) if last.role == Role::Assistant && reasoning.is_empty() && (last.tool_calls.is_some() || last.text().is_empty()) => last.tool_calls.get_or_insert_with(Vec::new).push(call),
                    _ => {
                        let mut m = ChatMessage { content: None, ..ChatMessage::new(Role::Assistant, "") };
                        m.tool_calls = Some(vec![call]);
                        if !reasoning.is_empty() {
                            m.reasoning_content = Some(std::mem::take(&mut reasoning).join("\n"));
                        }
                        messages.push(m);
                    }
                }
            }
            InputItem::FunctionCallOutput { call_id, output } => {
                let text = match output {
                    FunctionOutput::Text(t) => t.clone(),
                    FunctionOutput::Parts(p) => parts_text(p, &format!("{at}.output"))?,
                };
                messages.push(ChatMessage { tool_call_id: Some(call_id.clone()), ..ChatMessage::new(Role::Tool, text) });
            }
            InputItem::Reasoning { content, summary } => {
                let text: Vec<&str> = match content {
                    Some(c) if !c.is_empty() => c.iter().map(|t| t.text.as_str()).collect(),
                    _ => summary.iter().map(|t| t.text.as_str()).collect(),
                };
                if !text.is_empty() {
                    reasoning.push(text.join("\n"));
                }
            }
            InputItem::ItemReference { .. } => {
                return Err(invalid(at.clone(), format!("{at}: item references are not supported; send the items, or previous_response_id")));
            }
        }
    }
    if messages.is_empty() {
        return Err(invalid("input", "input: at least one item is required"));
    }
    Ok(messages)
}

/// The Responses request as a chat request (instructions first), and the conversation to
/// keep (without the instructions, which `previous_response_id` does not carry over).
fn to_chat(state: &AppState, req: &ResponsesRequest, previous: Option<&Stored>, offered: &Offered) -> Result<(ChatCompletionRequest, Vec<ChatMessage>), ApiError> {
    check_model(state, &req.model)?;
    if req.background == Some(true) {
        return Err(invalid("background", "background: responses are not run in the background on this server; leave it out"));
    }
    let kept = conversation(req, previous, offered)?;
    let mut messages = Vec::with_capacity(kept.len() + 1);
    if let Some(i) = req.instructions.as_ref().filter(|i| !i.is_empty()) {
        messages.push(ChatMessage::new(Role::System, i.clone()));
    }
    messages.extend(kept.iter().cloned());
    let tools = offered.tools.clone();
    let tool_choice = match &req.tool_choice {
        None => None,
        Some(Value::String(s)) => Some(ToolChoice::Mode(match s.as_str() {
            "none" => ToolChoiceMode::None,
            "auto" => ToolChoiceMode::Auto,
            "required" => ToolChoiceMode::Required,
            other => return Err(invalid("tool_choice", format!("tool_choice: expected none, auto or required, got \"{other}\""))),
        })),
        Some(v) if v["type"] == "function" && v["name"].is_string() => Some(ToolChoice::Function(NamedToolChoice { kind: Default::default(), function: FunctionName { name: v["name"].as_str().unwrap_or_default().into() } })),
        // allowed_tools and hosted tools' choices: the model decides among the functions.
        Some(_) => Some(ToolChoice::Mode(ToolChoiceMode::Auto)),
    };
    let response_format = match req.text.as_ref().and_then(|t| t.format.as_ref()) {
        None | Some(TextFormat::Text) => None,
        Some(TextFormat::JsonObject) => Some(ResponseFormat::JsonObject),
        Some(TextFormat::JsonSchema { name, schema, description, strict }) => {
            Some(ResponseFormat::JsonSchema { json_schema: JsonSchemaFormat { name: name.clone(), description: description.clone(), schema: Some(schema.clone()), strict: *strict } })
        }
    };
    let reasoning_effort = match req.reasoning.as_ref().and_then(|r| r.effort.as_deref()) {
        None => None,
        Some("none") => Some(ReasoningEffort::None),
        Some("minimal") => Some(ReasoningEffort::Minimal),
        Some("low") => Some(ReasoningEffort::Low),
        Some("medium") => Some(ReasoningEffort::Medium),
        Some("high" | "xhigh") => Some(ReasoningEffort::High),
        Some(other) => return Err(invalid("reasoning.effort", format!("reasoning.effort: unknown level \"{other}\""))),
    };
    let chat_req = ChatCompletionRequest {
        model: String::new(),
        messages,
        tools: (!tools.is_empty()).then(|| tools.clone()),
        tool_choice: if tools.is_empty() { None } else { tool_choice },
        parallel_tool_calls: req.parallel_tool_calls,
        response_format,
        reasoning_effort,
        temperature: req.temperature,
        top_p: req.top_p,
        ..ChatCompletionRequest::default()
    };
    Ok((chat_req, kept))
}

/// What a response shares, whole or streamed.
#[derive(Clone)]
struct Head {
    id: String,
    created_at: u64,
    model: String,
    req: Arc<ResponsesRequest>,
    offered: Arc<Offered>,
}

impl Head {
    fn response(&self, status: &str, output: Vec<OutputItem>, usage: Option<ResponseUsage>, incomplete: bool) -> ResponseObject {
        let r = &self.req;
        ResponseObject {
            id: self.id.clone(),
            object: Default::default(),
            created_at: self.created_at,
            status: status.into(),
            model: self.model.clone(),
            error: None,
            incomplete_details: incomplete.then(|| IncompleteDetails { reason: "max_output_tokens".into() }),
            instructions: r.instructions.clone(),
            output,
            parallel_tool_calls: r.parallel_tool_calls.unwrap_or(true),
            tool_choice: r.tool_choice.clone().unwrap_or_else(|| json!("auto")),
            tools: r.tools.iter().flatten().map(|t| serde_json::to_value(t).unwrap_or_default()).collect(),
            temperature: r.temperature,
            top_p: r.top_p,
            max_output_tokens: r.max_output_tokens,
            previous_response_id: r.previous_response_id.clone(),
            store: r.store != Some(false),
            text: json!({"format": r.text.as_ref().and_then(|t| t.format.as_ref()).map_or(json!({"type": "text"}), |f| serde_json::to_value(f).unwrap_or_default())}),
            usage,
        }
    }
}

fn usage(u: &Usage) -> ResponseUsage {
    ResponseUsage {
        input_tokens: u.prompt_tokens,
        input_tokens_details: CachedTokens { cached_tokens: u.prompt_tokens_details.map_or(0, |d| d.cached_tokens) },
        output_tokens: u.completion_tokens,
        output_tokens_details: ReasoningTokens { reasoning_tokens: 0 },
        total_tokens: u.prompt_tokens + u.completion_tokens,
    }
}

fn reasoning_item(id: String, text: String, status: &str) -> OutputItem {
    OutputItem::Reasoning { id, summary: Vec::new(), content: vec![ReasoningText { kind: "reasoning_text".into(), text }], status: status.into() }
}

fn message_item(id: String, text: Option<String>, status: &str) -> OutputItem {
    let content = text.map(|t| vec![output_text(t)]).unwrap_or_default();
    OutputItem::Message { id, role: "assistant".into(), status: status.into(), content }
}

fn output_text(text: String) -> OutputText {
    OutputText { kind: "output_text".into(), text, annotations: Vec::new() }
}

fn call_item(call: &HarmonyCall, status: &str, offered: &Offered) -> OutputItem {
    let (name, namespace) = offered.split(&call.name);
    OutputItem::FunctionCall { id: new_id("fc"), call_id: new_id("call"), name, namespace, arguments: call.arguments.clone(), status: status.into() }
}

/// The assistant's turn as a chat message, for the kept conversation.
fn as_chat_turn(output: &[OutputItem], offered: &Offered) -> ChatMessage {
    let mut m = ChatMessage { content: None, ..ChatMessage::new(Role::Assistant, "") };
    for item in output {
        match item {
            OutputItem::Reasoning { content, .. } => m.reasoning_content = Some(content.iter().map(|c| c.text.as_str()).collect()),
            OutputItem::Message { content, .. } => m.content = Some(openapi::MessageContent::Text(content.iter().map(|c| c.text.as_str()).collect())),
            OutputItem::FunctionCall { call_id, name, namespace, arguments, .. } => m
                .tool_calls
                .get_or_insert_with(Vec::new)
                .push(ToolCall { id: call_id.clone(), kind: Default::default(), function: FunctionCall { name: offered.offered(namespace.as_deref(), name), arguments: arguments.clone() } }),
        }
    }
    m
}

fn keep(state: &AppState, head: &Head, response: &ResponseObject, mut conversation: Vec<ChatMessage>) {
    if head.req.store != Some(false) {
        conversation.push(as_chat_turn(&response.output, &head.offered));
        state.responses.put(response.clone(), conversation);
    }
}

pub async fn create(State(state): State<Arc<AppState>>, ApiJson(req): ApiJson<ResponsesRequest>) -> Result<Response, ApiError> {
    generate::check_room(&state)?;
    let previous = match &req.previous_response_id {
        Some(id) => Some(state.responses.get(id).ok_or_else(|| invalid("previous_response_id", format!("previous_response_id: no stored response has the id '{id}' (responses are kept in memory, at most {MAX_STORED_RESPONSES})")))?),
        None => None,
    };
    let req = Arc::new(req);
    let offered = Arc::new(Offered::of(&req));
    let (prepared, kept) = {
        let state = state.clone();
        let req = req.clone();
        let offered = offered.clone();
        prepare::run(move || {
            let (chat_req, kept) = to_chat(&state, &req, previous.as_deref(), &offered)?;
            chat::prepare(&state, &chat_req, Input::CHAT).map(|p| (p, kept))
        })
        .await?
    };
    let head = Head { id: new_id("resp"), created_at: now_secs(), model: if req.model.is_empty() { state.model_id.clone() } else { req.model.clone() }, req: req.clone(), offered };
    let spec = GenSpec {
        id: head.id.clone(),
        prompt: prepared.prompt,
        sampling: prepared.sampling,
        max_tokens: req.max_output_tokens,
        stop: Vec::new(),
        logprobs: None,
        seed: None,
        prompt_field: "input",
    };
    let receivers = generate::start(&state, &spec, 1)?;
    let reasoning = (state.reasoning, prepared.opens_thinking);
    if req.stream {
        let events = ResponseEvents { state: state.clone(), head, kept, turn: TurnStream::new(reasoning), tool_use: prepared.tool_use, seq: 0, open: None, output: Vec::new(), finish: Finish::Stop };
        return Ok(stream::sse(receivers, spec.prompt.len(), events));
    }
    let choice = generate::collect_all(receivers).await?.pop().unwrap_or_default();
    let answer = Answer::of(choice.text, reasoning, prepared.tool_use.as_ref());
    let mut output = Vec::new();
    if !answer.reasoning.is_empty() {
        output.push(reasoning_item(new_id("rs"), answer.reasoning, "completed"));
    }
    if !answer.text.is_empty() || answer.calls.is_empty() {
        output.push(message_item(new_id("msg"), Some(answer.text), "completed"));
    }
    output.extend(answer.calls.iter().map(|c| call_item(c, "completed", &head.offered)));
    let incomplete = choice.finish == Some(Finish::Length) && answer.calls.is_empty();
    let u = usage(&stream::usage(spec.prompt.len(), choice.completion_tokens, choice.cached_tokens));
    let response = head.response(if incomplete { "incomplete" } else { "completed" }, output, Some(u), incomplete);
    keep(&state, &head, &response, kept);
    Ok(Json(response).into_response())
}

/// The kind of the output item being streamed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    Reasoning,
    Message,
}

/// A streamed response: `response.created` and `.in_progress`, each output item added,
/// filled (text, reasoning and argument deltas with their indices) and done, then
/// `response.completed` (or `.incomplete`). Function calls are decided at the end of the
/// turn, so each comes with its whole arguments.
struct ResponseEvents {
    state: Arc<AppState>,
    head: Head,
    kept: Vec<ChatMessage>,
    turn: TurnStream,
    tool_use: Option<ToolUse>,
    seq: u64,
    /// The item being streamed: its kind, id and text so far.
    open: Option<(Open, String, String)>,
    output: Vec<OutputItem>,
    finish: Finish,
}

impl ResponseEvents {
    fn event(&mut self, event: ResponseStreamEvent) -> SseEvent {
        let frame = ResponseStreamFrame { event, sequence_number: self.seq };
        self.seq += 1;
        stream::named(&frame)
    }

    fn index(&self) -> u32 {
        self.output.len() as u32
    }

    fn close_open(&mut self, out: &mut Vec<SseEvent>) {
        let Some((kind, id, text)) = self.open.take() else { return };
        let output_index = self.index();
        let item = match kind {
            Open::Reasoning => {
                out.push(self.event(ResponseStreamEvent::ReasoningTextDone { item_id: id.clone(), output_index, content_index: 0, text: text.clone() }));
                reasoning_item(id, text, "completed")
            }
            Open::Message => {
                out.push(self.event(ResponseStreamEvent::OutputTextDone { item_id: id.clone(), output_index, content_index: 0, text: text.clone(), logprobs: Vec::new() }));
                out.push(self.event(ResponseStreamEvent::ContentPartDone { item_id: id.clone(), output_index, content_index: 0, part: output_text(text.clone()) }));
                message_item(id, Some(text), "completed")
            }
        };
        out.push(self.event(ResponseStreamEvent::OutputItemDone { output_index, item: item.clone() }));
        self.output.push(item);
    }

    fn pieces(&mut self, pieces: Vec<Piece>) -> Vec<SseEvent> {
        let mut out = Vec::new();
        for p in pieces {
            let (kind, delta) = match p {
                Piece::Reasoning(r) => (Open::Reasoning, r),
                Piece::Text(t) => (Open::Message, t),
            };
            if self.open.as_ref().is_none_or(|o| o.0 != kind) {
                self.close_open(&mut out);
                let id = new_id(if kind == Open::Message { "msg" } else { "rs" });
                let output_index = self.index();
                let item = match kind {
                    Open::Reasoning => OutputItem::Reasoning { id: id.clone(), summary: Vec::new(), content: Vec::new(), status: "in_progress".into() },
                    Open::Message => message_item(id.clone(), None, "in_progress"),
                };
                out.push(self.event(ResponseStreamEvent::OutputItemAdded { output_index, item }));
                if kind == Open::Message {
                    out.push(self.event(ResponseStreamEvent::ContentPartAdded { item_id: id.clone(), output_index, content_index: 0, part: output_text(String::new()) }));
                }
                self.open = Some((kind, id, String::new()));
            }
            let output_index = self.index();
            let Some((_, id, text)) = self.open.as_mut() else { continue };
            text.push_str(&delta);
            let item_id = id.clone();
            out.push(self.event(match kind {
                Open::Reasoning => ResponseStreamEvent::ReasoningTextDelta { item_id, output_index, content_index: 0, delta },
                Open::Message => ResponseStreamEvent::OutputTextDelta { item_id, output_index, content_index: 0, delta, logprobs: Vec::new() },
            }));
        }
        out
    }
}

impl stream::Chunks for ResponseEvents {
    type Frame = SseEvent;

    fn opening(&mut self) -> Vec<SseEvent> {
        let r = Box::new(self.head.response("in_progress", Vec::new(), None, false));
        vec![self.event(ResponseStreamEvent::Created { response: r.clone() }), self.event(ResponseStreamEvent::InProgress { response: r })]
    }

    fn text(&mut self, _: usize, text: String, _: Option<TokenInfo>) -> Vec<SseEvent> {
        let pieces = self.turn.push(text, self.tool_use.as_ref());
        self.pieces(pieces)
    }

    fn finish(&mut self, _: usize, finish: Finish) -> Vec<SseEvent> {
        let (rest, calls) = self.turn.finish(self.tool_use.as_ref());
        let mut out = self.pieces(rest);
        if calls.is_empty() && self.open.is_none() && !self.output.iter().any(|o| matches!(o, OutputItem::Message { .. })) {
            // An empty answer is still a message.
            out.extend(self.pieces(vec![Piece::Text(String::new())]));
        }
        self.close_open(&mut out);
        for call in &calls {
            let output_index = self.index();
            let item = call_item(call, "completed", &self.head.offered);
            let OutputItem::FunctionCall { id, name, namespace, arguments, call_id, .. } = &item else { continue };
            let added = OutputItem::FunctionCall { id: id.clone(), call_id: call_id.clone(), name: name.clone(), namespace: namespace.clone(), arguments: String::new(), status: "in_progress".into() };
            let (id, name, arguments) = (id.clone(), name.clone(), arguments.clone());
            out.push(self.event(ResponseStreamEvent::OutputItemAdded { output_index, item: added }));
            out.push(self.event(ResponseStreamEvent::FunctionCallArgumentsDelta { item_id: id.clone(), output_index, delta: arguments.clone() }));
            out.push(self.event(ResponseStreamEvent::FunctionCallArgumentsDone { item_id: id, output_index, name, arguments }));
            out.push(self.event(ResponseStreamEvent::OutputItemDone { output_index, item: item.clone() }));
            self.output.push(item);
        }
        self.finish = if calls.is_empty() { finish } else { Finish::Stop };
        out
    }

    fn done(&mut self, u: Usage) -> Vec<SseEvent> {
        let incomplete = self.finish == Finish::Length;
        let response = self.head.response(if incomplete { "incomplete" } else { "completed" }, std::mem::take(&mut self.output), Some(usage(&u)), incomplete);
        keep(&self.state, &self.head, &response, std::mem::take(&mut self.kept));
        let response = Box::new(response);
        vec![self.event(if incomplete { ResponseStreamEvent::Incomplete { response } } else { ResponseStreamEvent::Completed { response } })]
    }

    fn failure(&mut self, e: &ApiError) -> Vec<SseEvent> {
        let mut response = self.head.response("failed", std::mem::take(&mut self.output), None, false);
        let body = e.body().error;
        response.error = Some(json!({"code": body.code.unwrap_or_else(|| "server_error".into()), "message": body.message}));
        vec![self.event(ResponseStreamEvent::Failed { response: Box::new(response) })]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response(id: &str) -> ResponseObject {
        let head = Head { id: id.into(), created_at: 0, model: "m".into(), req: Arc::new(ResponsesRequest::default()), offered: Arc::default() };
        head.response("completed", Vec::new(), None, false)
    }

    #[test]
    fn namespaced_functions_are_offered_by_their_names_and_called_back_with_their_namespace() {
        // Codex's shapes: a plain function, its sub-agent namespace, an MCP namespace whose
        // function's name is taken, and a hosted tool left out.
        let req: ResponsesRequest = serde_json::from_value(json!({
            "model": "", "input": "hi",
            "tools": [
                {"type": "function", "name": "shell", "parameters": {"type": "object"}},
                {"type": "namespace", "name": "collaboration", "description": "sub-agents", "tools": [
                    {"type": "function", "name": "spawn_agent", "description": "spawns", "strict": false, "parameters": {"type": "object"}},
                    {"type": "function", "name": "wait", "parameters": {"type": "object"}}
                ]},
                {"type": "namespace", "name": "mcp__files__", "description": "files", "tools": [{"type": "function", "name": "shell", "parameters": {"type": "object"}}]},
                {"type": "web_search"}
            ]
        }))
        .unwrap();
        let o = Offered::of(&req);
        let names: Vec<&str> = o.tools.iter().map(|t| t.function.name.as_str()).collect();
        assert_eq!(names, ["shell", "spawn_agent", "wait", "mcp__files__shell"]);
        assert_eq!(o.split("spawn_agent"), ("spawn_agent".to_string(), Some("collaboration".to_string())));
        assert_eq!(o.split("mcp__files__shell"), ("shell".to_string(), Some("mcp__files__".to_string())));
        assert_eq!(o.split("shell"), ("shell".to_string(), None));
        assert_eq!(o.offered(Some("mcp__files__"), "shell"), "mcp__files__shell");
        assert_eq!(o.offered(Some("collaboration"), "wait"), "wait");
        assert_eq!(o.offered(None, "shell"), "shell");
        let OutputItem::FunctionCall { name, namespace, .. } = call_item(&HarmonyCall { name: "spawn_agent".into(), arguments: "{}".into() }, "completed", &o) else { unreachable!() };
        assert_eq!((name.as_str(), namespace.as_deref()), ("spawn_agent", Some("collaboration")));
    }

    #[test]
    fn the_store_drops_the_oldest_past_its_count_and_byte_caps() {
        let store = ResponseStore::default();
        for i in 0..MAX_STORED_RESPONSES + 5 {
            store.put(response(&format!("r{i}")), vec![ChatMessage::new(Role::User, "hi")]);
        }
        assert!(store.get("r4").is_none() && store.get("r5").is_some() && store.get(&format!("r{}", MAX_STORED_RESPONSES + 4)).is_some());
        // A conversation of a third of the byte cap: three fit, the fourth pushes the first out.
        let big = "x".repeat(MAX_STORED_BYTES / 3 - 4096);
        for i in 0..4 {
            store.put(response(&format!("big{i}")), vec![ChatMessage::new(Role::User, big.clone())]);
        }
        assert!(store.get("big0").is_none() && store.get("big1").is_some() && store.get("big3").is_some());
        assert!(store.inner.lock().unwrap().bytes <= MAX_STORED_BYTES);
        // One larger than the whole cap is not kept, and evicts nothing.
        store.put(response("huge"), vec![ChatMessage::new(Role::User, "x".repeat(MAX_STORED_BYTES))]);
        assert!(store.get("huge").is_none() && store.get("big3").is_some());
        assert!(store.remove("big3") && !store.remove("big3"));
    }
}
