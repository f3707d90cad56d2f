//! `POST /v1/chat/completions`.

use std::sync::Arc;

use axum::extract::State;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use engine::sampler::{Sampler, SamplingParams};
use openapi::{
    AssistantMessage, ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatMessage, ChoiceLogprobs, ChunkChoice, Delta, FinishReason, FunctionCall,
    FunctionCallDelta, ResponseFormat, Role, ToolCall, ToolCallDelta, ToolChoice, ToolChoiceMode, TopLogprob, Usage,
};
use serde_json::{json, Value};

use super::error::ApiError;
use super::generate::{self, finish_reason, Choice, GenSpec};
use super::json::ApiJson;
use super::prepare;
use super::reasoning::Splitter;
use super::turn::{Answer, Piece, ReasoningSetup, TurnStream};
use super::stream;
use super::tools::{self, ToolUse};
use super::{check_model, AppState};
use crate::process::now_secs;
use crate::runtime::generation::{Finish, TokenInfo};

pub async fn chat_completions(State(state): State<Arc<AppState>>, ApiJson(req): ApiJson<ChatCompletionRequest>) -> Result<Response, ApiError> {
    generate::check_room(&state)?;
    let (req, prepared) = {
        let state = state.clone();
        prepare::run(move || prepare(&state, &req, Input::CHAT).map(|p| (req, p))).await?
    };
    let Prepared { prompt, sampling, tool_use, opens_thinking } = prepared;
    let reasoning = (state.reasoning, opens_thinking);
    let id = format!("chatcmpl-{}", uuid::Uuid::new_v4().simple());
    let spec = GenSpec {
        id: id.clone(),
        prompt,
        sampling,
        max_tokens: req.max_new_tokens(),
        stop: req.stop_sequences(),
        logprobs: req.logprobs_requested().map(|k| k as usize),
        seed: req.seed,
        prompt_field: "messages",
    };
    let n = req.choices() as usize;
    let receivers = generate::start(&state, &spec, n)?;
    let meta = Meta { id, created: now_secs(), model: state.model_id.clone(), fingerprint: state.fingerprint.clone(), prompt_tokens: spec.prompt.len() };
    if req.stream {
        let prompt_tokens = meta.prompt_tokens;
        let chunks = ChatChunks { meta, usage_field: req.include_usage().then_some(None), tool_use, choices: (0..n).map(|_| TurnStream::new(reasoning)).collect() };
        Ok(stream::sse(receivers, prompt_tokens, chunks))
    } else {
        let choices = generate::collect_all(receivers).await?;
        Ok(Json(response(meta, choices, tool_use.as_ref(), reasoning)).into_response())
    }
}

/// The chat-template variable that turns a model's thinking on or off (Qwen3, DeepSeek,
/// GLM and the other templates with a thinking mode read it): what Anthropic's `thinking`
/// and Ollama's `think` switch.
pub(super) const THINKING_SWITCH: &str = "enable_thinking";

/// What the model reads of a chat request.
#[derive(Clone, Copy)]
pub(super) enum Input<'a> {
    /// The messages through the chat template; a `prefill` (Anthropic's last assistant
    /// turn) is the start of the answer, which the model continues.
    Chat { prefill: Option<&'a str> },
    /// The one message's text as it is, with no template (Ollama's `raw`).
    Raw,
}

impl Input<'_> {
    pub const CHAT: Input<'static> = Input::Chat { prefill: None };
}

/// A chat request made ready to generate.
pub(super) struct Prepared {
    pub prompt: Vec<i32>,
    pub sampling: SamplingParams,
    pub tool_use: Option<ToolUse>,
    /// The rendered prompt leaves the model inside a `<think>` block.
    pub opens_thinking: bool,
}

/// Everything a chat request needs before generation, all of it CPU work that may take a
/// while for large requests: it runs on a preparation thread (`prepare::run`).
pub(super) fn prepare(state: &AppState, req: &ChatCompletionRequest, input: Input) -> Result<Prepared, ApiError> {
    req.validate(&state.limits)?;
    check_model(state, &req.model)?;
    // The content alone may show the prompt cannot fit; then nothing is rendered.
    generate::check_prompt_bytes(state, req.messages.iter().map(|m| m.text().len()).sum(), "messages")?;
    let tool_use = tool_use(req);
    let (prompt, opens_thinking) = match input {
        Input::Raw => {
            // The model's whole input as the client wrote it, control tokens included.
            let text = req.messages.first().map(ChatMessage::text).unwrap_or_default();
            (state.tokenizer.tokenize(&text, true), Splitter::prompt_opens_thinking(&text))
        }
        Input::Chat { prefill } => {
            let messages = template_messages(&req.messages, tool_use.as_ref(), state.template_knows_tools);
            let tools_for_template = tool_use.as_ref().filter(|_| state.template_knows_tools).map(|t| Value::Array(t.tools.clone()));
            let rendered = state.template.render_chat_with(&messages, tools_for_template.as_ref(), true, &req.template_variables())?;
            generate::check_prompt_bytes(state, rendered.text.len(), "messages")?;
            let mut prompt = state.tokenizer.tokenize_chat(&rendered)?;
            let mut opens_thinking = Splitter::prompt_opens_thinking(&rendered.text);
            if let Some(text) = prefill {
                // The client's text, never control tokens, and no BOS: it continues the
                // rendered prompt.
                prompt.extend(state.tokenizer.tokenize_with(text, false, false));
                opens_thinking = Splitter::prompt_opens_thinking(&format!("{}{text}", rendered.text));
            }
            (prompt, opens_thinking)
        }
    };

    fn invalid(param: &'static str) -> impl Fn(String) -> ApiError {
        move |message| ApiError::InvalidParameter { param: Some(param.into()), message }
    }
    let (grammar, grammar_param) = match (&tool_use, &req.response_format) {
        (Some(t), _) if t.required => (Some(tools::tool_call_grammar(&t.tools, &t.names).map_err(invalid("tools"))?), "tools"),
        (_, Some(ResponseFormat::JsonObject)) => (Some(tools::json_grammar(None).map_err(invalid("response_format"))?), "response_format"),
        (_, Some(ResponseFormat::JsonSchema { json_schema })) => (Some(tools::json_grammar(json_schema.schema.as_ref()).map_err(invalid("response_format"))?), "response_format"),
        _ => (None, ""),
    };
    let has_grammar = grammar.is_some();
    // A grammar holds the output from its first token (a required tool call, a JSON
    // answer), so none of it is thinking, even where the template's generation prompt
    // opened a think block (Qwen3.5's does): read as reasoning, the call or the JSON was
    // lost to `reasoning_content`.
    let opens_thinking = opens_thinking && !has_grammar;
    let sampling = generate::sampling_params(req.sampling(), grammar)?;
    // Build the sampler once here so a bad logit_bias or grammar is the client's 400, not
    // a failure inside the batching loop.
    Sampler::new(&state.tokenizer, &sampling).map_err(|e| match e {
        // llama.cpp refuses some grammars the conversion wrote (say, a string of at least
        // 100,000 characters: too many repetitions); the schema is the client's.
        engine::Error::Sampler(m) if has_grammar && sampling.logit_bias.is_empty() => invalid(grammar_param)(format!("the schema gives a grammar llama.cpp refuses ({m}); large minLength/maxLength/minItems/maxItems are the usual cause")),
        other => ApiError::from(other),
    })?;
    Ok(Prepared { prompt, sampling, tool_use, opens_thinking })
}

struct Meta {
    id: String,
    created: u64,
    model: String,
    fingerprint: String,
    prompt_tokens: usize,
}

fn tool_use(req: &ChatCompletionRequest) -> Option<ToolUse> {
    let tools: Vec<Value> = req.tools.as_ref()?.iter().map(|t| serde_json::to_value(t).unwrap_or(Value::Null)).collect();
    if tools.is_empty() {
        return None;
    }
    let (required, names) = match &req.tool_choice {
        Some(ToolChoice::Mode(ToolChoiceMode::None)) => return None,
        None | Some(ToolChoice::Mode(ToolChoiceMode::Auto)) => (false, Vec::new()),
        Some(ToolChoice::Mode(ToolChoiceMode::Required)) => (true, Vec::new()),
        Some(ToolChoice::Function(f)) => (true, vec![f.function.name.clone()]),
    };
    Some(ToolUse { tools, required, names, single: req.parallel_tool_calls == Some(false) })
}

/// OpenAI messages as the chat template sees them. Without template support for tools,
/// tool definitions become a system message, earlier calls are written as the model is
/// asked to write them, and tool results are handed back as user turns.
fn template_messages(messages: &[ChatMessage], tool_use: Option<&ToolUse>, template_knows_tools: bool) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::with_capacity(messages.len() + 1);
    for m in messages {
        let mut content = m.text();
        let calls = m.tool_calls.as_deref().unwrap_or_default();
        match (m.role, template_knows_tools) {
            (Role::Tool, false) => {
                out.push(json!({"role": "user", "content": format!("<tool_response>\n{content}\n</tool_response>")}));
                continue;
            }
            (Role::Assistant, false) if !calls.is_empty() => {
                for c in calls {
                    if !content.is_empty() {
                        content.push('\n');
                    }
                    content.push_str(&tools::render_tool_call(&c.function.name, &c.function.arguments));
                }
            }
            _ => {}
        }
        let mut v = json!({"role": m.role.template_role(), "content": content});
        // Earlier thinking, under the names templates read it by (Qwen3: reasoning_content,
        // gpt-oss: thinking); most templates drop it from past turns themselves.
        if let (Role::Assistant, Some(r)) = (m.role, &m.reasoning_content) {
            v["reasoning_content"] = json!(r);
            v["thinking"] = json!(r);
        }
        if template_knows_tools {
            if !calls.is_empty() {
                v["tool_calls"] = json!(calls
                    .iter()
                    .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": serde_json::from_str::<Value>(&c.function.arguments).unwrap_or(Value::String(c.function.arguments.clone()))}}))
                    .collect::<Vec<_>>());
            }
            if let Some(id) = &m.tool_call_id {
                v["tool_call_id"] = json!(id);
            }
        }
        out.push(v);
    }
    if let (Some(t), false) = (tool_use, template_knows_tools) {
        let prompt = tools::tools_system_prompt(&t.tools);
        match out.first_mut() {
            Some(first) if first["role"] == "system" => {
                let existing = first["content"].as_str().unwrap_or_default().to_string();
                first["content"] = json!(format!("{existing}\n\n{prompt}"));
            }
            _ => out.insert(0, json!({"role": "system", "content": prompt})),
        }
    }
    out
}

fn logprobs_of(tokens: &[TokenInfo]) -> ChoiceLogprobs {
    ChoiceLogprobs {
        content: Some(
            tokens
                .iter()
                .map(|t| openapi::TokenLogprob {
                    token: t.logprob.token.clone(),
                    logprob: t.logprob.logprob,
                    bytes: Some(t.logprob.bytes.clone()),
                    top_logprobs: t.top.iter().map(|a| TopLogprob { token: a.token.clone(), logprob: a.logprob, bytes: Some(a.bytes.clone()) }).collect(),
                })
                .collect(),
        ),
        refusal: None,
    }
}

pub(super) fn new_call_id() -> String {
    format!("call_{}", &uuid::Uuid::new_v4().simple().to_string()[..24])
}

fn response(meta: Meta, choices: Vec<Choice>, tool_use: Option<&ToolUse>, reasoning: ReasoningSetup) -> ChatCompletionResponse {
    let completion: usize = choices.iter().map(|c| c.completion_tokens).sum();
    let cached = choices.iter().map(|c| c.cached_tokens).max().unwrap_or(0);
    let choices = choices
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let logprobs = (!c.tokens.is_empty()).then(|| logprobs_of(&c.tokens));
            let answer = Answer::of(c.text, reasoning, tool_use);
            let reasoning_content = (!answer.reasoning.is_empty()).then_some(answer.reasoning);
            let (content, tool_calls, finish) = if answer.calls.is_empty() {
                (Some(answer.text), None, finish_reason(c.finish.unwrap_or(Finish::Stop)))
            } else {
                let calls = answer.calls.into_iter().map(|p| ToolCall { id: new_call_id(), kind: Default::default(), function: FunctionCall { name: p.name, arguments: p.arguments } }).collect();
                (None, Some(calls), FinishReason::ToolCalls)
            };
            ChatChoice { index: i as u32, message: AssistantMessage { role: Default::default(), content, reasoning_content, tool_calls }, logprobs, finish_reason: finish }
        })
        .collect();
    ChatCompletionResponse {
        id: meta.id,
        object: Default::default(),
        created: meta.created,
        model: meta.model,
        choices,
        usage: stream::usage(meta.prompt_tokens, completion, cached),
        system_fingerprint: meta.fingerprint,
    }
}

/// Chat's chunks: a role chunk per choice first; content as it comes, unless the request
/// has tools and the text may still be a tool call (then it is held back and decided at
/// the end: one tool-call chunk, or the held text as content); a finish chunk per choice.
struct ChatChunks {
    meta: Meta,
    /// Every chunk carries `usage: null` when usage was asked for.
    usage_field: Option<Option<Usage>>,
    tool_use: Option<ToolUse>,
    choices: Vec<TurnStream>,
}

impl ChatChunks {
    fn chunk(&self, choice: ChunkChoice) -> SseEvent {
        let m = &self.meta;
        stream::data(&ChatCompletionChunk { id: m.id.clone(), object: Default::default(), created: m.created, model: m.model.clone(), system_fingerprint: m.fingerprint.clone(), choices: vec![choice], usage: self.usage_field })
    }

    fn delta(&self, i: usize, delta: Delta, logprobs: Option<ChoiceLogprobs>, finish_reason: Option<FinishReason>) -> SseEvent {
        self.chunk(ChunkChoice { index: i as u32, delta, logprobs, finish_reason })
    }

    fn content(&self, i: usize, text: String, logprobs: Option<ChoiceLogprobs>) -> SseEvent {
        self.delta(i, Delta { content: Some(text), ..Delta::default() }, logprobs, None)
    }

    /// The chunks of a turn's pieces. The token's log-probabilities ride on the answer's
    /// first chunk, else on the thinking's, else on an empty answer chunk.
    fn emit(&self, i: usize, pieces: Vec<Piece>, info: Option<TokenInfo>) -> Vec<SseEvent> {
        let mut logprobs = info.map(|t| logprobs_of(&[t]));
        let carrier = pieces.iter().position(|p| matches!(p, Piece::Text(_))).or((!pieces.is_empty()).then_some(0));
        let mut out: Vec<SseEvent> = pieces
            .into_iter()
            .enumerate()
            .map(|(k, p)| {
                let lp = if Some(k) == carrier { logprobs.take() } else { None };
                match p {
                    Piece::Reasoning(r) => self.delta(i, Delta { reasoning_content: Some(r), ..Delta::default() }, lp, None),
                    Piece::Text(t) => self.content(i, t, lp),
                }
            })
            .collect();
        if logprobs.is_some() {
            out.push(self.content(i, String::new(), logprobs));
        }
        out
    }
}

impl stream::Chunks for ChatChunks {
    type Frame = SseEvent;

    fn failure(&mut self, e: &ApiError) -> Vec<SseEvent> {
        stream::openai_failure(e)
    }

    fn opening(&mut self) -> Vec<SseEvent> {
        (0..self.choices.len())
            .map(|i| self.chunk(ChunkChoice { index: i as u32, delta: Delta { role: Some(Default::default()), content: Some(String::new()), ..Delta::default() }, logprobs: None, finish_reason: None }))
            .collect()
    }

    fn text(&mut self, i: usize, text: String, info: Option<TokenInfo>) -> Vec<SseEvent> {
        let pieces = self.choices[i].push(text, self.tool_use.as_ref());
        self.emit(i, pieces, info)
    }

    fn finish(&mut self, i: usize, finish: Finish) -> Vec<SseEvent> {
        let (rest, calls) = self.choices[i].finish(self.tool_use.as_ref());
        let mut out = self.emit(i, rest, None);
        let mut reason = finish_reason(finish);
        if !calls.is_empty() {
            let deltas = calls
                .into_iter()
                .enumerate()
                .map(|(k, c)| ToolCallDelta { index: k as u32, id: Some(new_call_id()), kind: Some(Default::default()), function: FunctionCallDelta { name: Some(c.name), arguments: Some(c.arguments) } })
                .collect();
            out.push(self.delta(i, Delta { tool_calls: Some(deltas), ..Delta::default() }, None, None));
            reason = FinishReason::ToolCalls;
        }
        out.push(self.delta(i, Delta::default(), None, Some(reason)));
        out
    }

    fn done(&mut self, usage: Usage) -> Vec<SseEvent> {
        let m = &self.meta;
        let chunk = self.usage_field.is_some().then(|| stream::data(&ChatCompletionChunk { id: m.id.clone(), object: Default::default(), created: m.created, model: m.model.clone(), system_fingerprint: m.fingerprint.clone(), choices: vec![], usage: Some(Some(usage)) }));
        stream::openai_done(chunk)
    }
}
