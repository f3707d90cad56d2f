//! The HTTP handlers against a fake runtime: status codes, error envelopes, SSE framing
//! and the admin endpoints, with no model loaded (the tokenizer and chat template come
//! from the default model's vocabulary; no weights are read). Each fake answers every
//! sequence with a script of events, so what the handlers make of each event is checked
//! exactly.

mod common;

use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use engine::chat_template::ChatTemplate;
use engine::tokenizer::Tokenizer;
use hearth::error::ReplanError;
use hearth::http::reasoning::ReasoningFormat;
use hearth::http::server::EndlessStreams;
use hearth::http::{AppState, WebPolicy};
use hearth::runtime::generation::{Event, Finish, GenerationRequest, SubmitError};
use hearth::runtime::ring::board::PlanBoard;
use hearth::runtime::views::{ClusterView, PlanView};
use hearth::runtime::{ReplanReply, Runtime};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

/// What the fake does with a submitted sequence.
#[derive(Clone)]
enum Script {
    /// Sends these events, in order, at once.
    Events(Vec<ScriptEvent>),
    /// Refuses it.
    Refuse(SubmitError),
}

#[derive(Clone)]
enum ScriptEvent {
    Started(usize),
    Token(&'static str),
    /// Text that is not `'static`.
    Text(String),
    Done(Finish, usize),
    Failed(&'static str),
    Unavailable(&'static str),
}

struct Fake {
    script: Script,
    degraded: Option<String>,
    /// Every sequence submitted: (prompt length, max_tokens, temperature).
    seen: Mutex<Vec<(usize, usize, f32)>>,
    board: PlanBoard,
}

impl Fake {
    fn new(script: Script) -> Fake {
        Fake { script, degraded: None, seen: Mutex::default(), board: PlanBoard::single(30) }
    }
}

impl Runtime for Fake {
    fn submit(&self, req: GenerationRequest) -> Result<(), SubmitError> {
        self.seen.lock().unwrap().push((req.prompt.len(), req.max_tokens, req.sampling.temperature));
        let events = match &self.script {
            Script::Refuse(e) => return Err(e.clone()),
            Script::Events(e) => e.clone(),
        };
        for e in events {
            let _ = req.events.send(match e {
                ScriptEvent::Started(cached_tokens) => Event::Started { cached_tokens },
                ScriptEvent::Token(t) => Event::Token { text: t.into(), info: None },
                ScriptEvent::Text(t) => Event::Token { text: t, info: None },
                ScriptEvent::Done(finish, completion_tokens) => Event::Done { finish, completion_tokens },
                ScriptEvent::Failed(m) => Event::Failed(m.into()),
                ScriptEvent::Unavailable(m) => Event::Unavailable(m.into()),
            });
        }
        Ok(())
    }
    fn has_room(&self) -> Result<(), SubmitError> {
        match &self.script {
            Script::Refuse(e) => Err(e.clone()),
            Script::Events(_) => Ok(()),
        }
    }
    fn n_ctx(&self) -> usize {
        512
    }
    fn parallel(&self) -> usize {
        2
    }
    fn degraded(&self) -> Option<String> {
        self.degraded.clone()
    }
    fn plan(&self) -> PlanView {
        self.board.view()
    }
    fn cluster(&self) -> ClusterView {
        self.board.cluster()
    }
    fn replan(&self, _: Option<scheduler::Strategy>) -> Result<ReplanReply, ReplanError> {
        Err(ReplanError::NotARing)
    }
    fn shutdown(&self) {}
}

fn vocabulary() -> Arc<Tokenizer> {
    static TOKENIZER: std::sync::OnceLock<Arc<Tokenizer>> = std::sync::OnceLock::new();
    TOKENIZER.get_or_init(|| Arc::new(Tokenizer::load(common::vocabulary_fixture()).expect("the vocabulary fixture"))).clone()
}

fn app(fake: Arc<Fake>, admin_key: Option<&str>) -> axum::Router {
    app_with(fake, admin_key, None)
}

/// `app`, with the reasoning format of another model's template when given.
fn app_with(fake: Arc<Fake>, admin_key: Option<&str>, reasoning: Option<ReasoningFormat>) -> axum::Router {
    app_guarded(fake, admin_key, reasoning, WebPolicy::default(), EndlessStreams::default())
}

/// `app_with`, with the given Host and CORS policy and console stream slots.
fn app_guarded(fake: Arc<Fake>, admin_key: Option<&str>, reasoning: Option<ReasoningFormat>, web: WebPolicy, endless: EndlessStreams) -> axum::Router {
    hearth::metrics::install();
    let tokenizer = vocabulary();
    let source = tokenizer.chat_template_source().expect("a chat template");
    let template = ChatTemplate::new(&source, &tokenizer.bos_text(), &tokenizer.eos_text()).unwrap();
    let state = Arc::new(AppState {
        runtime: fake,
        tokenizer,
        template_knows_tools: source.contains("tools"),
        reasoning: reasoning.unwrap_or(ReasoningFormat::detect(&source)),
        template,
        model_id: "fake".into(),
        created: 0,
        fingerprint: "hearth-test".into(),
        api_key: None,
        admin_key: admin_key.map(str::to_string),
        limits: openapi::Limits { max_n: 2, ..Default::default() },
        body_limit: 1 << 20,
        facts: Default::default(),
        responses: Default::default(),
        embeddings: None,
        web,
        endless,
    });
    hearth::http::router(state)
}

fn happy() -> Script {
    Script::Events(vec![ScriptEvent::Started(3), ScriptEvent::Token("Hel"), ScriptEvent::Token("lo"), ScriptEvent::Done(Finish::Stop, 2)])
}

async fn call(app: axum::Router, method: &str, path: &str, body: Option<Value>, bearer: Option<&str>) -> (StatusCode, axum::http::HeaderMap, String) {
    let mut req = Request::builder().method(method).uri(path).header("content-type", "application/json");
    if let Some(k) = bearer {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let req = req.body(body.map_or(Body::empty(), |b| Body::from(b.to_string()))).unwrap();
    let resp = app.oneshot(req).await.unwrap();
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (parts.status, parts.headers, String::from_utf8(bytes.to_vec()).unwrap())
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": "fake", "messages": [{"role": "user", "content": "Say hello"}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn completion(extra: Value) -> Value {
    let mut body = json!({"model": "fake", "prompt": "Say hello"});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// The `data:` payloads of an SSE body; asserts every event is one `data:` line.
fn sse(body: &str) -> Vec<String> {
    assert!(body.ends_with("\n\n"), "an SSE body ends with a blank line: {body:?}");
    body.trim_end().split("\n\n").map(|e| e.strip_prefix("data: ").unwrap_or_else(|| panic!("not a data event: {e:?}")).to_string()).collect()
}

fn envelope(status: StatusCode, body: &str, want: StatusCode, code: Option<&str>) -> Value {
    assert_eq!(status, want, "{body}");
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"));
    assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(v["error"]["type"].is_string(), "{v}");
    if let Some(c) = code {
        assert_eq!(v["error"]["code"], c, "{v}");
    }
    v
}

#[tokio::test]
async fn a_chat_answer_is_the_scripted_text_with_its_usage() {
    let fake = Arc::new(Fake::new(happy()));
    let (status, _, body) = call(app(fake.clone(), None), "POST", "/v1/chat/completions", Some(chat(json!({"max_tokens": 7}))), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], "Hello");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["completion_tokens"], 2);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 3);
    let seen = fake.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(v["usage"]["prompt_tokens"], seen[0].0);
    assert_eq!(seen[0].1, 7, "max_tokens reaches the runtime");
    assert_eq!(seen[0].2, 1.0, "OpenAI's default temperature");
}

#[tokio::test]
async fn n_choices_each_get_a_sequence() {
    let fake = Arc::new(Fake::new(happy()));
    let (status, _, body) = call(app(fake.clone(), None), "POST", "/v1/chat/completions", Some(chat(json!({"n": 2}))), None).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(fake.seen.lock().unwrap().len(), 2);
    // More than the runtime generates at once is the client's mistake.
    let (status, _, body) = call(app(fake, None), "POST", "/v1/chat/completions", Some(chat(json!({"n": 3}))), None).await;
    envelope(status, &body, StatusCode::BAD_REQUEST, None);
}

#[tokio::test]
async fn chat_and_completion_streams_are_framed_alike() {
    for (path, body) in [("/v1/chat/completions", chat(json!({"stream": true, "stream_options": {"include_usage": true}}))), ("/v1/completions", completion(json!({"stream": true, "stream_options": {"include_usage": true}})))] {
        let fake = Arc::new(Fake::new(happy()));
        let (status, headers, text) = call(app(fake, None), "POST", path, Some(body), None).await;
        assert_eq!(status, StatusCode::OK, "{path}: {text}");
        assert!(headers["content-type"].to_str().unwrap().starts_with("text/event-stream"), "{path}");
        let events = sse(&text);
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{path}: {events:?}");
        let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
        let text_of = |c: &Value| c["choices"][0]["delta"]["content"].as_str().or(c["choices"][0]["text"].as_str()).unwrap_or("").to_string();
        let streamed: String = chunks.iter().map(text_of).collect();
        assert_eq!(streamed, "Hello", "{path}");
        let finishes: Vec<&Value> = chunks.iter().filter(|c| c["choices"][0]["finish_reason"].is_string()).collect();
        assert_eq!(finishes.len(), 1, "{path}: one finish chunk");
        assert_eq!(finishes[0]["choices"][0]["finish_reason"], "stop", "{path}");
        // The usage chunk comes last, with no choices, and counts the cached prompt tokens.
        let usage = chunks.last().unwrap();
        assert_eq!(usage["choices"].as_array().map(Vec::len), Some(0), "{path}: {usage}");
        assert_eq!(usage["usage"]["completion_tokens"], 2, "{path}: {usage}");
        assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 3, "{path}: {usage}");
    }
}

#[tokio::test]
async fn a_full_queue_is_429_with_retry_after_and_no_sequence_submitted() {
    let fake = Arc::new(Fake::new(Script::Refuse(SubmitError::QueueFull)));
    for (path, body) in [("/v1/chat/completions", chat(json!({}))), ("/v1/completions", completion(json!({})))] {
        let (status, headers, text) = call(app(fake.clone(), None), "POST", path, Some(body), None).await;
        envelope(status, &text, StatusCode::TOO_MANY_REQUESTS, Some("rate_limit_exceeded"));
        assert!(headers.contains_key("retry-after"), "{path}");
    }
    assert!(fake.seen.lock().unwrap().is_empty(), "refused before preparation: nothing reached submit");
}

#[tokio::test]
async fn a_lost_ring_member_is_503_and_shows_on_health() {
    let mut fake = Fake::new(Script::Refuse(SubmitError::Unavailable("worker 10.0.0.2:9090 is unreachable".into())));
    fake.degraded = Some("worker 10.0.0.2:9090 is unreachable".into());
    let app = app(Arc::new(fake), None);
    let (status, _, text) = call(app.clone(), "POST", "/v1/chat/completions", Some(chat(json!({}))), None).await;
    let v = envelope(status, &text, StatusCode::SERVICE_UNAVAILABLE, Some("ring_unavailable"));
    assert!(v["error"]["message"].as_str().unwrap().contains("10.0.0.2:9090"), "{v}");
    let (status, _, text) = call(app, "GET", "/health", None, None).await;
    assert_eq!(status, StatusCode::OK);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["status"], "degraded");
    assert!(v["reason"].as_str().unwrap().contains("10.0.0.2"), "{v}");
}

#[tokio::test]
async fn an_engine_failure_is_a_generic_500_and_a_member_failure_a_503() {
    let failed = Script::Events(vec![ScriptEvent::Started(0), ScriptEvent::Token("Hel"), ScriptEvent::Failed("ggml aborted: secret detail")]);
    let (status, _, text) = call(app(Arc::new(Fake::new(failed)), None), "POST", "/v1/chat/completions", Some(chat(json!({}))), None).await;
    let v = envelope(status, &text, StatusCode::INTERNAL_SERVER_ERROR, None);
    assert!(!text.contains("secret detail"), "internal details stay in the log: {v}");
    let lost = Script::Events(vec![ScriptEvent::Started(0), ScriptEvent::Unavailable("worker w2 closed the ring link")]);
    let (status, _, text) = call(app(Arc::new(Fake::new(lost)), None), "POST", "/v1/completions", Some(completion(json!({}))), None).await;
    envelope(status, &text, StatusCode::SERVICE_UNAVAILABLE, Some("ring_unavailable"));
}

#[tokio::test]
async fn a_failure_mid_stream_ends_the_stream_with_an_error_event() {
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let failed = Script::Events(vec![ScriptEvent::Started(0), ScriptEvent::Token("Hel"), ScriptEvent::Unavailable("worker w2 closed the ring link")]);
        let body = if path.contains("chat") { chat(json!({"stream": true})) } else { completion(json!({"stream": true})) };
        let (status, _, text) = call(app(Arc::new(Fake::new(failed)), None), "POST", path, Some(body), None).await;
        assert_eq!(status, StatusCode::OK, "the stream had started: {text}");
        let events = sse(&text);
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{path}: {events:?}");
        let error: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
        assert_eq!(error["error"]["code"], "ring_unavailable", "{path}: {error}");
        assert!(events.iter().all(|e| !e.contains("\"finish_reason\":\"stop\"")), "{path}: a failed choice does not finish normally: {events:?}");
    }
}

#[tokio::test]
async fn the_admin_endpoints_are_guarded_and_answer_typed_refusals() {
    let fake = Arc::new(Fake::new(happy()));
    let (status, _, text) = call(app(fake.clone(), None), "GET", "/admin/plan", None, None).await;
    envelope(status, &text, StatusCode::FORBIDDEN, Some("admin_disabled"));
    let app = app(fake, Some("k"));
    let (status, _, text) = call(app.clone(), "GET", "/admin/plan", None, Some("wrong")).await;
    envelope(status, &text, StatusCode::UNAUTHORIZED, Some("invalid_admin_key"));
    let (status, _, text) = call(app.clone(), "GET", "/admin/plan", None, Some("k")).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let plan: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(plan["source"], "single", "{plan}");
    let (status, _, text) = call(app.clone(), "POST", "/admin/replan", None, Some("k")).await;
    let v = envelope(status, &text, StatusCode::CONFLICT, Some("conflict"));
    assert!(v["error"]["message"].as_str().unwrap().contains("--workers"), "{v}");
    let (status, _, text) = call(app, "POST", "/admin/replan", Some(json!({"strategy": "no-such"})), Some("k")).await;
    envelope(status, &text, StatusCode::BAD_REQUEST, None);
}

#[tokio::test]
async fn bad_requests_never_reach_the_runtime() {
    let fake = Arc::new(Fake::new(happy()));
    let app = app(fake.clone(), None);
    let cases = [
        ("/v1/chat/completions", json!({"model": "fake", "messages": []}), StatusCode::BAD_REQUEST),
        ("/v1/chat/completions", json!({"model": "other", "messages": [{"role": "user", "content": "x"}]}), StatusCode::NOT_FOUND),
        ("/v1/chat/completions", json!({"model": "fake", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}), StatusCode::BAD_REQUEST),
        ("/v1/completions", json!({"model": "fake", "prompt": "x".repeat(8000)}), StatusCode::BAD_REQUEST),
        ("/v1/nothing", json!({}), StatusCode::NOT_FOUND),
    ];
    for (path, body, want) in cases {
        let (status, _, text) = call(app.clone(), "POST", path, Some(body.clone()), None).await;
        envelope(status, &text, want, None);
    }
    assert!(fake.seen.lock().unwrap().is_empty());
}

#[tokio::test]
async fn streamed_tool_calls_are_held_back_and_sent_as_one_delta() {
    let weather = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let call = Script::Events(vec![
        ScriptEvent::Started(0),
        ScriptEvent::Token("<tool_"),
        ScriptEvent::Text(r#"call>{"name": "get_weather", "arguments": {"city": "Oslo"}}"#.into()),
        ScriptEvent::Token("</tool_call>"),
        ScriptEvent::Done(Finish::Stop, 3),
    ]);
    let (status, _, text) = call_app(call.clone(), chat(json!({"tools": weather, "stream": true}))).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let chunks: Vec<Value> = sse(&text).iter().filter(|e| *e != "[DONE]").map(|e| serde_json::from_str(e).unwrap()).collect();
    assert!(chunks.iter().all(|c| c["choices"][0]["delta"]["content"].as_str().is_none_or(str::is_empty)), "no tool-call text leaks as content: {chunks:?}");
    let calls: Vec<&Value> = chunks.iter().filter(|c| c["choices"][0]["delta"]["tool_calls"].is_array()).collect();
    assert_eq!(calls.len(), 1, "{chunks:?}");
    let f = &calls[0]["choices"][0]["delta"]["tool_calls"][0]["function"];
    assert_eq!(f["name"], "get_weather");
    assert_eq!(serde_json::from_str::<Value>(f["arguments"].as_str().unwrap()).unwrap(), json!({"city": "Oslo"}));
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");
    // The same answer whole.
    let (status, _, text) = call_app(call, chat(json!({"tools": weather}))).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(v["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "get_weather");

    // Text that only began like a call is content after all, none of it lost.
    let prose = Script::Events(vec![ScriptEvent::Started(0), ScriptEvent::Token("<to"), ScriptEvent::Token("day is sunny"), ScriptEvent::Done(Finish::Stop, 2)]);
    let (_, _, text) = call_app(prose, chat(json!({"tools": weather, "stream": true}))).await;
    let chunks: Vec<Value> = sse(&text).iter().filter(|e| *e != "[DONE]").map(|e| serde_json::from_str(e).unwrap()).collect();
    let content: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(content, "<today is sunny");
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");
}

async fn call_app(script: Script, body: Value) -> (StatusCode, axum::http::HeaderMap, String) {
    call(app(Arc::new(Fake::new(script)), None), "POST", "/v1/chat/completions", Some(body), None).await
}

/// Streams a chat request against a model with `format` and returns its chunks (without
/// `[DONE]`), with the whole answer to the same request.
async fn reasoning_run(format: ReasoningFormat, tokens: &[&'static str], extra: Value) -> (Vec<Value>, Value) {
    let mut events = vec![ScriptEvent::Started(0)];
    events.extend(tokens.iter().map(|&t| ScriptEvent::Token(t)));
    events.push(ScriptEvent::Done(Finish::Stop, tokens.len()));
    let script = Script::Events(events);
    let mut streamed = extra.clone();
    streamed["stream"] = json!(true);
    let (status, _, text) = call(app_with(Arc::new(Fake::new(script.clone())), None, Some(format)), "POST", "/v1/chat/completions", Some(chat(streamed)), None).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let chunks = sse(&text).iter().filter(|e| *e != "[DONE]").map(|e| serde_json::from_str(e).unwrap()).collect();
    let (status, _, text) = call(app_with(Arc::new(Fake::new(script)), None, Some(format)), "POST", "/v1/chat/completions", Some(chat(extra)), None).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    (chunks, serde_json::from_str(&text).unwrap())
}

fn streamed_field(chunks: &[Value], field: &str) -> String {
    chunks.iter().filter_map(|c| c["choices"][0]["delta"][field].as_str()).collect()
}

/// gpt-oss writes harmony: its analysis channel is the reasoning, its final channel the
/// answer, and none of the channel markup reaches the client.
#[tokio::test]
async fn harmony_channels_become_reasoning_content_and_content() {
    let tokens = ["<|channel|>", "analysis", "<|message|>", "The user", " greets me.", "<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "Hel", "lo!"];
    let (chunks, whole) = reasoning_run(ReasoningFormat::Harmony, &tokens, json!({})).await;
    assert_eq!(streamed_field(&chunks, "reasoning_content"), "The user greets me.");
    assert_eq!(streamed_field(&chunks, "content"), "Hello!");
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");
    let m = &whole["choices"][0]["message"];
    assert_eq!((m["reasoning_content"].as_str(), m["content"].as_str()), (Some("The user greets me."), Some("Hello!")), "{whole}");

    // A call to a function is a tool call, the analysis before it reasoning.
    let weather = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let tokens = ["<|channel|>", "analysis", "<|message|>", "Need the weather.", "<|start|>", "assistant", "<|channel|>", "commentary to=functions.get_weather ", "<|constrain|>", "json", "<|message|>", "{\"city\":", "\"Oslo\"}"];
    let (chunks, whole) = reasoning_run(ReasoningFormat::Harmony, &tokens, json!({"tools": weather})).await;
    assert_eq!(streamed_field(&chunks, "reasoning_content"), "Need the weather.");
    assert_eq!(streamed_field(&chunks, "content"), "");
    let calls: Vec<&Value> = chunks.iter().filter(|c| c["choices"][0]["delta"]["tool_calls"].is_array()).collect();
    assert_eq!(calls.len(), 1, "{chunks:?}");
    assert_eq!(calls[0]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"], "get_weather");
    assert_eq!(calls[0]["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"], "{\"city\":\"Oslo\"}");
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");
    let m = &whole["choices"][0]["message"];
    assert_eq!(m["tool_calls"][0]["function"]["name"], "get_weather", "{whole}");
    assert_eq!(m["reasoning_content"], "Need the weather.");
    assert!(m["content"].is_null(), "{whole}");
}

/// Qwen3, DeepSeek-R1 and GLM write `<think>…</think>` before the answer.
#[tokio::test]
async fn think_blocks_become_reasoning_content() {
    let tokens = ["<think>", "\nShort greeting", ".\n", "</think>", "\n\n", "Hi", " there"];
    let (chunks, whole) = reasoning_run(ReasoningFormat::ThinkTags, &tokens, json!({})).await;
    assert_eq!(streamed_field(&chunks, "reasoning_content"), "\nShort greeting.\n");
    assert_eq!(streamed_field(&chunks, "content"), "Hi there");
    let m = &whole["choices"][0]["message"];
    assert_eq!((m["reasoning_content"].as_str(), m["content"].as_str()), (Some("\nShort greeting.\n"), Some("Hi there")));
    // Earlier thinking sent back with the history is taken (and handed to the template).
    let history = json!({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi there", "reasoning_content": "Short greeting."}, {"role": "user", "content": "Again"}]});
    let (_, whole) = reasoning_run(ReasoningFormat::ThinkTags, &tokens, history).await;
    assert_eq!(whole["choices"][0]["message"]["content"], "Hi there");
    // A model without reasoning markup in its template keeps every character as content.
    let (chunks, whole) = reasoning_run(ReasoningFormat::None, &tokens, json!({})).await;
    assert_eq!(streamed_field(&chunks, "content"), "<think>\nShort greeting.\n</think>\n\nHi there");
    assert!(whole["choices"][0]["message"].get("reasoning_content").is_none(), "{whole}");
}

/// Anthropic's events of an SSE body as (event name, data); every frame is named.
fn named_events(body: &str) -> Vec<(String, Value)> {
    body.trim_end()
        .split("\n\n")
        .filter(|f| !f.starts_with(':'))
        .map(|f| {
            let name = f.lines().find_map(|l| l.strip_prefix("event: ")).unwrap_or_else(|| panic!("no event line: {f:?}"));
            let data: Value = serde_json::from_str(f.lines().find_map(|l| l.strip_prefix("data: ")).unwrap()).unwrap();
            assert_eq!(data["type"], name);
            (name.to_string(), data)
        })
        .collect()
}

fn message(extra: Value) -> Value {
    let mut body = json!({"model": "claude-opus-4-1", "max_tokens": 50, "messages": [{"role": "user", "content": "Say hello"}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// Thinking comes as its own block before the text, whole and streamed (with the empty
/// signature Anthropic's SDK expects before the block closes).
#[tokio::test]
async fn anthropic_thinking_is_a_thinking_block() {
    let tokens = ["<think>", "\nShort greeting", ".\n", "</think>", "\n\n", "Hi", " there"];
    let mut events = vec![ScriptEvent::Started(3)];
    events.extend(tokens.iter().map(|&t| ScriptEvent::Token(t)));
    events.push(ScriptEvent::Done(Finish::Stop, tokens.len()));
    let script = Script::Events(events);
    let run = |body: Value| {
        let script = script.clone();
        async move { call(app_with(Arc::new(Fake::new(script)), None, Some(ReasoningFormat::ThinkTags)), "POST", "/v1/messages", Some(body), None).await }
    };
    let (status, _, text) = run(message(json!({"thinking": {"type": "enabled", "budget_tokens": 1024}}))).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let m: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(m["content"], json!([{"type": "thinking", "thinking": "\nShort greeting.\n", "signature": ""}, {"type": "text", "text": "Hi there"}]));
    assert_eq!((m["stop_reason"].as_str(), m["usage"]["output_tokens"].as_u64(), m["usage"]["cache_read_input_tokens"].as_u64()), (Some("end_turn"), Some(7), Some(3)));
    let (status, _, text) = run(message(json!({"stream": true}))).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let names: Vec<String> = named_events(&text).into_iter().map(|(n, d)| if n == "content_block_delta" { d["delta"]["type"].as_str().unwrap().to_string() } else { n }).collect();
    let want = ["message_start", "ping", "content_block_start", "thinking_delta", "thinking_delta", "signature_delta", "content_block_stop", "content_block_start", "text_delta", "text_delta", "content_block_stop", "message_delta", "message_stop"];
    assert_eq!(names, want);
    // message_start waits for the prompt to be processed, so its usage splits the prompt as
    // message_delta's does: the 3 tokens the batcher reused are cache reads.
    let events = named_events(&text);
    let (start, end) = (&events[0].1["message"]["usage"], &events[events.len() - 2].1["usage"]);
    assert_eq!(start["cache_read_input_tokens"], 3, "{start}");
    for key in ["input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"] {
        assert_eq!(start[key], end[key], "{key}: {start} vs {end}");
    }
}

#[tokio::test]
async fn anthropic_failures_are_anthropic_errors_before_and_during_a_stream() {
    let failed = Script::Events(vec![ScriptEvent::Started(0), ScriptEvent::Token("Hel"), ScriptEvent::Unavailable("worker w2 closed the ring link")]);
    let (status, _, text) = call(app(Arc::new(Fake::new(failed)), None), "POST", "/v1/messages", Some(message(json!({"stream": true}))), None).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let events = named_events(&text);
    let (name, err) = events.last().unwrap();
    assert_eq!(name, "error", "{events:?}");
    assert_eq!(err["error"]["type"], "api_error");
    assert!(err["error"]["message"].as_str().unwrap().contains("w2"), "{err}");
    assert!(events.iter().all(|(n, _)| n != "message_stop"), "{events:?}");
    // At capacity: Anthropic's 529 overloaded_error, with Retry-After.
    let (status, headers, text) = call(app(Arc::new(Fake::new(Script::Refuse(SubmitError::QueueFull))), None), "POST", "/v1/messages", Some(message(json!({}))), None).await;
    assert_eq!(status.as_u16(), 529, "{text}");
    assert!(headers.contains_key("retry-after"));
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!((v["type"].as_str(), v["error"]["type"].as_str()), (Some("error"), Some("overloaded_error")), "{v}");
    // An engine failure says nothing of itself.
    let broken = Script::Events(vec![ScriptEvent::Failed("secret detail")]);
    let (status, _, text) = call(app(Arc::new(Fake::new(broken)), None), "POST", "/v1/messages", Some(message(json!({}))), None).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(!text.contains("secret detail") && text.contains("api_error"), "{text}");
}

/// Ollama's chat: thinking in `message.thinking`, tool calls as one line whose arguments
/// are objects, then the `done` line.
#[tokio::test]
async fn ollama_chunks_carry_thinking_and_object_arguments() {
    let tokens = ["<think>", "hm", "</think>", "<tool_call>", "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}", "</tool_call>"];
    let mut events = vec![ScriptEvent::Started(0)];
    events.extend(tokens.iter().map(|&t| ScriptEvent::Token(t)));
    events.push(ScriptEvent::Done(Finish::Stop, tokens.len()));
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]);
    let body = json!({"model": "fake:latest", "messages": [{"role": "user", "content": "Weather?"}], "tools": tools});
    let app = || app_with(Arc::new(Fake::new(Script::Events(events.clone()))), None, Some(ReasoningFormat::ThinkTags));
    let (status, headers, text) = call(app(), "POST", "/api/chat", Some(body.clone()), None).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(headers["content-type"], "application/x-ndjson");
    let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let thinking: String = lines.iter().filter_map(|l| l["message"]["thinking"].as_str()).collect();
    assert_eq!(thinking, "hm");
    let call_line = lines.iter().find(|l| l["message"]["tool_calls"].is_array()).expect("a tool call line");
    assert_eq!(call_line["message"]["tool_calls"][0]["function"]["arguments"], json!({"city": "Oslo"}));
    assert_eq!(lines.last().unwrap()["done"], true);
    let mut whole = body;
    whole["stream"] = json!(false);
    let (_, _, text) = call(app(), "POST", "/api/chat", Some(whole), None).await;
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!((v["message"]["thinking"].as_str(), v["message"]["tool_calls"][0]["function"]["name"].as_str()), (Some("hm"), Some("get_weather")), "{v}");
    // A failure mid-stream is an error line.
    let failed = Script::Events(vec![ScriptEvent::Started(0), ScriptEvent::Token("Hel"), ScriptEvent::Unavailable("worker w2 closed the ring link")]);
    let (status, _, text) = call(app_with(Arc::new(Fake::new(failed)), None, None), "POST", "/api/generate", Some(json!({"model": "fake", "prompt": "hi"})), None).await;
    assert_eq!(status, StatusCode::OK);
    let last: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    assert!(last["error"].as_str().unwrap().contains("w2"), "{text}");
}

#[tokio::test]
async fn embeddings_without_an_embedding_model_say_how_to_serve_one() {
    let fake = Arc::new(Fake::new(happy()));
    let (status, _, body) = call(app(fake.clone(), None), "POST", "/v1/embeddings", Some(json!({"input": "hello"})), None).await;
    let err = envelope(status, &body, StatusCode::BAD_REQUEST, None);
    assert!(err["error"]["message"].as_str().unwrap().contains("--embedding-model"), "{err}");
    for path in ["/api/embed", "/api/embeddings"] {
        let (status, _, body) = call(app(fake.clone(), None), "POST", path, Some(json!({"model": "fake", "input": "hello", "prompt": "hello"})), None).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert!(v["error"].as_str().unwrap().contains("--embedding-model"), "{path}: {v}");
    }
    // The model list has the chat model only.
    let (_, _, body) = call(app(fake, None), "GET", "/v1/models", None, None).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["data"].as_array().unwrap().len(), 1);
}

/// A request with exactly these headers (no content type unless given).
async fn raw(app: axum::Router, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> (StatusCode, axum::http::HeaderMap, String) {
    let mut req = Request::builder().method(method).uri(path);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = app.oneshot(req.body(Body::from(body.to_string())).unwrap()).await.unwrap();
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.unwrap().to_bytes();
    (parts.status, parts.headers, String::from_utf8(bytes.to_vec()).unwrap())
}

/// The generation routes of each API, with a body each takes, and a check that an error
/// is in that API's envelope with the given OpenAI code (or Anthropic type).
fn generation_routes() -> Vec<(&'static str, Value, fn(&Value, &str))> {
    fn openai(v: &Value, code: &str) {
        assert_eq!(v["error"]["code"], code, "{v}");
        assert!(v["error"]["message"].is_string(), "{v}");
    }
    fn anthropic(v: &Value, kind: &str) {
        assert_eq!((v["type"].as_str(), v["error"]["type"].as_str()), (Some("error"), Some(kind)), "{v}");
    }
    fn ollama(v: &Value, _: &str) {
        assert!(v["error"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    }
    vec![
        ("/v1/chat/completions", chat(json!({})), openai as fn(&Value, &str)),
        ("/v1/completions", completion(json!({})), openai as fn(&Value, &str)),
        ("/v1/messages", message(json!({})), anthropic as fn(&Value, &str)),
        ("/api/chat", json!({"model": "fake", "messages": [{"role": "user", "content": "hi"}], "stream": false}), ollama as fn(&Value, &str)),
        ("/api/generate", json!({"model": "fake", "prompt": "hi", "stream": false}), ollama as fn(&Value, &str)),
    ]
}

/// What a web page may send to any address without asking the server first — a form, a
/// `text/plain` body, an untyped body (a Blob) from a page, which always says where it is
/// from — is refused with 415 on every JSON route, in its API's envelope, and never runs;
/// JSON, and an untyped body from a client that is not a browser, are taken.
#[tokio::test]
async fn bodies_a_web_page_can_send_unasked_are_refused_with_415_and_never_run() {
    let fake = Arc::new(Fake::new(happy()));
    let forged: [&[(&str, &str)]; 5] = [
        &[("content-type", "text/plain")],
        &[("content-type", "text/plain;charset=UTF-8"), ("origin", "https://evil.example")],
        &[("content-type", "application/x-www-form-urlencoded")],
        &[("content-type", "multipart/form-data; boundary=xyz")],
        &[("origin", "https://evil.example")],
    ];
    for (path, body, check) in generation_routes() {
        for headers in forged {
            let (status, _, text) = raw(app(fake.clone(), None), "POST", path, headers, &body.to_string()).await;
            assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{path} {headers:?}: {text}");
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}"));
            check(&v, if path == "/v1/messages" { "invalid_request_error" } else { "unsupported_media_type" });
            assert!(text.contains("application/json"), "{path}: the refusal says what to send: {text}");
        }
        assert!(fake.seen.lock().unwrap().is_empty(), "{path}: a refused request ran");
    }
    for path in ["/tokenize", "/v1/embeddings", "/api/show", "/api/pull"] {
        let (status, _, text) = raw(app(fake.clone(), None), "POST", path, &[("content-type", "text/plain")], r#"{"content": "hi", "model": "fake", "input": "hi"}"#).await;
        assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{path}: {text}");
    }
    for (path, body, _) in generation_routes() {
        for headers in [&[("content-type", "application/json")][..], &[("content-type", "application/json; charset=utf-8"), ("origin", "http://127.0.0.1:8080")], &[]] {
            let (status, _, text) = raw(app(fake.clone(), None), "POST", path, headers, &body.to_string()).await;
            assert_eq!(status, StatusCode::OK, "{path} {headers:?}: {text}");
        }
    }
    assert_eq!(fake.seen.lock().unwrap().len(), 15);
}

/// A request that names the server by a foreign host (a DNS-rebinding page) is refused
/// on every route, key or none, in its API's envelope, before anything runs; IP
/// addresses, loopback names, no Host, and the allow-list's names are served.
#[tokio::test]
async fn a_foreign_host_is_refused_on_every_route_and_served_names_are_not() {
    let fake = Arc::new(Fake::new(happy()));
    let evil = [("host", "evil.example:8080"), ("content-type", "application/json")];
    for path in ["/", "/health", "/metrics", "/console/state", "/v1/models", "/openapi.json", "/api/tags", "/api/version", "/console/console.js"] {
        let (status, _, text) = raw(app(fake.clone(), None), "GET", path, &evil, "").await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{path}: {text}");
        assert!(text.contains("evil.example") && text.contains("--allowed-hosts"), "{path}: {text}");
    }
    let (status, _, text) = raw(app(fake.clone(), None), "GET", "/console/state", &[("host", "evil.example"), ("accept", "text/event-stream")], "").await;
    envelope(status, &text, StatusCode::FORBIDDEN, Some("host_not_allowed"));
    for (path, body, check) in generation_routes() {
        let (status, _, text) = raw(app(fake.clone(), None), "POST", path, &evil, &body.to_string()).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{path}: {text}");
        check(&serde_json::from_str(&text).unwrap(), if path == "/v1/messages" { "permission_error" } else { "host_not_allowed" });
    }
    assert!(fake.seen.lock().unwrap().is_empty(), "a refused request ran");
    for host in ["127.0.0.1:8080", "localhost:8080", "LOCALHOST", "[::1]:8080", "192.168.1.20:8080", "10.0.0.5"] {
        let (status, _, text) = raw(app(fake.clone(), None), "GET", "/v1/models", &[("host", host)], "").await;
        assert_eq!(status, StatusCode::OK, "{host}: {text}");
    }
    let (status, _, _) = raw(app(fake.clone(), None), "GET", "/metrics", &[], "").await;
    assert_eq!(status, StatusCode::OK, "no Host at all");
    let listed = |hosts: &[&str]| WebPolicy::new(&hosts.iter().map(|h| h.to_string()).collect::<Vec<_>>(), &[]).unwrap();
    let guarded = |web: WebPolicy| app_guarded(fake.clone(), None, None, web, EndlessStreams::default());
    for (web, host, want) in [
        (listed(&["hearth.local"]), "hearth.local:8080", StatusCode::OK),
        (listed(&["hearth.local"]), "evil.example", StatusCode::FORBIDDEN),
        (listed(&["*.home.arpa"]), "pc.home.arpa", StatusCode::OK),
        (listed(&["*"]), "evil.example", StatusCode::OK),
    ] {
        let (status, _, text) = raw(guarded(web), "GET", "/console/state", &[("host", host)], "").await;
        assert_eq!(status, want, "{host}: {text}");
    }
}

/// No CORS grant unless origins are configured, preflight or not; with them, exactly
/// those origins get one, and a preflight for the SDKs' headers is answered.
#[tokio::test]
async fn cors_grants_nothing_by_default_and_only_the_configured_origins() {
    let fake = Arc::new(Fake::new(happy()));
    let preflight = |origin: &'static str| {
        [("origin", origin), ("access-control-request-method", "POST"), ("access-control-request-headers", "authorization,content-type")]
    };
    let (status, headers, _) = raw(app(fake.clone(), None), "GET", "/v1/models", &[("origin", "http://app.example")], "").await;
    assert_eq!(status, StatusCode::OK);
    assert!(!headers.contains_key("access-control-allow-origin"), "{headers:?}");
    let (_, headers, _) = raw(app(fake.clone(), None), "OPTIONS", "/v1/chat/completions", &preflight("http://app.example"), "").await;
    assert!(headers.keys().all(|k| !k.as_str().starts_with("access-control-")), "{headers:?}");

    let web = WebPolicy::new(&[], &["http://app.example".into()]).unwrap();
    let cors = || app_guarded(fake.clone(), None, None, web.clone(), EndlessStreams::default());
    let (status, headers, _) = raw(cors(), "GET", "/v1/models", &[("origin", "http://app.example")], "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["access-control-allow-origin"], "http://app.example");
    let (status, headers, _) = raw(cors(), "OPTIONS", "/v1/chat/completions", &preflight("http://app.example"), "").await;
    assert!(status.is_success(), "{status}");
    assert_eq!(headers["access-control-allow-origin"], "http://app.example");
    assert!(headers["access-control-allow-methods"].to_str().unwrap().contains("POST"), "{headers:?}");
    assert!(headers["access-control-allow-headers"].to_str().unwrap().contains("authorization"), "{headers:?}");
    let (_, headers, _) = raw(cors(), "POST", "/v1/chat/completions", &[("origin", "http://app.example"), ("content-type", "application/json")], &chat(json!({})).to_string()).await;
    assert_eq!(headers["access-control-allow-origin"], "http://app.example");
    for (method, h) in [("GET", &[("origin", "http://other.example")][..]), ("OPTIONS", &preflight("http://other.example")[..])] {
        let (_, headers, _) = raw(cors(), method, "/v1/chat/completions", h, "").await;
        assert!(!headers.contains_key("access-control-allow-origin"), "{method}: {headers:?}");
    }
    let any = WebPolicy::new(&[], &["*".into()]).unwrap();
    let (_, headers, _) = raw(app_guarded(fake.clone(), None, None, any, EndlessStreams::default()), "GET", "/v1/models", &[("origin", "http://other.example")], "").await;
    assert_eq!(headers["access-control-allow-origin"], "*");
}

/// Console streams hold a slot each while they run: past the cap a new one is refused
/// with 503 (the page retries), and a slot is free again once a stream is dropped.
#[tokio::test]
async fn console_streams_past_their_cap_get_503_until_one_ends() {
    let fake = Arc::new(Fake::new(happy()));
    let streams = EndlessStreams::new(2);
    let app = || app_guarded(fake.clone(), None, None, WebPolicy::default(), streams.clone());
    let open = || {
        let (app, req) = (app(), Request::builder().uri("/console/state").header("accept", "text/event-stream").body(Body::empty()).unwrap());
        async move { app.oneshot(req).await.unwrap() }
    };
    let first = open().await;
    let second = open().await;
    for r in [&first, &second] {
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()["connection"], "close", "a stream's connection ends with it");
    }
    let third = open().await;
    assert_eq!(third.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(third.headers().contains_key("retry-after"));
    let text = String::from_utf8(third.into_body().collect().await.unwrap().to_bytes().to_vec()).unwrap();
    envelope(StatusCode::SERVICE_UNAVAILABLE, &text, StatusCode::SERVICE_UNAVAILABLE, Some("too_many_streams"));
    // A snapshot is no stream: it takes no slot.
    let (status, _, _) = call(app(), "GET", "/console/state", None, None).await;
    assert_eq!(status, StatusCode::OK);
    drop(first);
    assert_eq!(open().await.status(), StatusCode::OK);
    drop(second);
}
