//! The other APIs clients point at a home server, in-process on the default model: each
//! must say what chat completions say for the same conversation (greedy, so the same
//! text), in its own shapes, events and error envelope. The real SDKs drive the same
//! routes in tests/client_sdks.rs.

mod common;

use std::sync::Arc;

use hearth::http::AppState;
use serde_json::{json, Value};

struct Server {
    base: String,
    #[allow(dead_code)]
    state: Arc<AppState>,
    client: reqwest::Client,
}

const KEY: &str = "k3y";

async fn start() -> Server {
    let (base, state) = common::serve_in_process(&["--threads", "1", "--ctx-size", "1024", "--parallel", "4", "--api-key", KEY]).await;
    Server { base, state, client: reqwest::Client::new() }
}

impl Server {
    /// A POST the way Anthropic's SDK sends it (`x-api-key`, `anthropic-version`).
    async fn anthropic(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self.client.post(format!("{}{path}", self.base)).header("x-api-key", KEY).header("anthropic-version", "2023-06-01").json(body).send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// A streamed Messages response as (event name, data) pairs.
    async fn anthropic_stream(&self, body: &Value) -> Vec<(String, Value)> {
        let r = self.client.post(format!("{}/v1/messages?beta=true", self.base)).header("x-api-key", KEY).header("anthropic-beta", "fine-grained-tool-streaming-2025-05-14").json(body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
        let text = r.text().await.unwrap();
        text.split("\n\n")
            .filter(|f| !f.trim().is_empty() && !f.starts_with(':'))
            .map(|frame| {
                let name = frame.lines().find_map(|l| l.strip_prefix("event: ")).unwrap_or_else(|| panic!("a frame without `event:`: {frame}"));
                let data = frame.lines().find_map(|l| l.strip_prefix("data: ")).unwrap_or_else(|| panic!("a frame without `data:`: {frame}"));
                let data: Value = serde_json::from_str(data).unwrap();
                assert_eq!(data["type"], name, "the event name is the data's type");
                (name.to_string(), data)
            })
            .collect()
    }

    async fn chat(&self, body: &Value) -> Value {
        let r = self.client.post(format!("{}/v1/chat/completions", self.base)).bearer_auth(KEY).json(body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        r.json().await.unwrap()
    }
}

/// The text of a streamed message, checking Anthropic's event order on the way: one
/// `message_start` first, blocks opened, filled and closed in index order, then
/// `message_delta` and `message_stop` last.
fn streamed_message(events: &[(String, Value)]) -> (Vec<Value>, Value) {
    assert_eq!(events.first().map(|e| e.0.as_str()), Some("message_start"), "{events:?}");
    assert_eq!(events.last().map(|e| e.0.as_str()), Some("message_stop"), "{events:?}");
    let mut blocks: Vec<Value> = Vec::new();
    let mut open: Option<usize> = None;
    let mut delta = Value::Null;
    for (name, data) in &events[1..events.len() - 1] {
        match name.as_str() {
            "ping" => {}
            "content_block_start" => {
                assert!(open.is_none(), "a block opened inside another: {events:?}");
                let index = data["index"].as_u64().unwrap() as usize;
                assert_eq!(index, blocks.len(), "indices are positions: {events:?}");
                blocks.push(data["content_block"].clone());
                open = Some(index);
            }
            "content_block_delta" => {
                let index = data["index"].as_u64().unwrap() as usize;
                assert_eq!(Some(index), open);
                let b = &mut blocks[index];
                let d = &data["delta"];
                match d["type"].as_str().unwrap() {
                    "text_delta" => b["text"] = json!(format!("{}{}", b["text"].as_str().unwrap(), d["text"].as_str().unwrap())),
                    "thinking_delta" => b["thinking"] = json!(format!("{}{}", b["thinking"].as_str().unwrap(), d["thinking"].as_str().unwrap())),
                    "signature_delta" => {}
                    "input_json_delta" => {
                        let so_far = b.get("partial").and_then(Value::as_str).unwrap_or_default().to_string();
                        b["partial"] = json!(format!("{so_far}{}", d["partial_json"].as_str().unwrap()));
                    }
                    other => panic!("unknown delta {other}"),
                }
            }
            "content_block_stop" => {
                assert_eq!(open, Some(data["index"].as_u64().unwrap() as usize));
                let b = &mut blocks[open.take().unwrap()];
                if let Some(p) = b.as_object_mut().unwrap().remove("partial") {
                    b["input"] = serde_json::from_str(p.as_str().unwrap()).unwrap();
                }
            }
            "message_delta" => {
                assert!(open.is_none());
                delta = data.clone();
            }
            other => panic!("unexpected event {other}: {events:?}"),
        }
    }
    assert!(delta.is_object(), "no message_delta: {events:?}");
    (blocks, delta)
}

fn text_of(blocks: &[Value]) -> String {
    blocks.iter().filter(|b| b["type"] == "text").map(|b| b["text"].as_str().unwrap()).collect()
}

const WEATHER_SCHEMA: &str = r#"{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages_say_what_chat_says_whole_and_streamed() {
    let s = start().await;
    let system = "You are a concise assistant.";
    let question = "What is the capital of France?";
    let chat = s.chat(&json!({"model": "", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}], "max_tokens": 24, "temperature": 0})).await;
    let want = chat["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(!want.is_empty());

    // The system prompt as blocks, a Claude model name, cache_control and unknown fields:
    // all as Claude Code sends them.
    let body = json!({
        "model": "claude-sonnet-4-6", "max_tokens": 24, "temperature": 0,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": question, "cache_control": {"type": "ephemeral"}}]}],
        "metadata": {"user_id": "someone"}, "context_management": {"edits": []}
    });
    let (status, msg) = s.anthropic("/v1/messages?beta=true", &body).await;
    assert_eq!(status, 200, "{msg}");
    assert_eq!((msg["type"].as_str(), msg["role"].as_str(), msg["model"].as_str()), (Some("message"), Some("assistant"), Some("claude-sonnet-4-6")));
    assert!(msg["id"].as_str().unwrap().starts_with("msg_"));
    let blocks = msg["content"].as_array().unwrap();
    assert_eq!(text_of(blocks), want, "{msg}");
    let finish = chat["choices"][0]["finish_reason"].as_str().unwrap();
    let want_reason = if finish == "length" { "max_tokens" } else { "end_turn" };
    assert_eq!(msg["stop_reason"], want_reason, "{msg}");
    assert!(msg["stop_sequence"].is_null());
    let usage = &msg["usage"];
    let prompt = chat["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(usage["input_tokens"].as_u64().unwrap() + usage["cache_read_input_tokens"].as_u64().unwrap(), prompt, "{usage}");
    assert_eq!(usage["output_tokens"], chat["usage"]["completion_tokens"]);

    // count_tokens counts that prompt.
    let count = json!({"model": "claude-haiku-4-5", "system": system, "messages": [{"role": "user", "content": question}]});
    let (status, counted) = s.anthropic("/v1/messages/count_tokens", &count).await;
    assert_eq!(status, 200, "{counted}");
    assert_eq!(counted, json!({"input_tokens": prompt}));

    // Streamed: the same text, in Anthropic's event order.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = s.anthropic_stream(&streamed).await;
    assert_eq!(events[1].0, "ping");
    assert!(events[0].1["message"]["content"].as_array().unwrap().is_empty());
    assert!(events[0].1["message"]["stop_reason"].is_null());
    let (blocks, delta) = streamed_message(&events);
    assert_eq!(text_of(&blocks), want);
    assert_eq!(delta["delta"]["stop_reason"], want_reason);
    assert_eq!(delta["usage"]["output_tokens"], chat["usage"]["completion_tokens"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_stop_sequences_prefill_and_long_conversations() {
    let s = start().await;
    let question = json!([{"role": "user", "content": "Count from one to ten in words, separated by commas."}]);
    let (_, free) = s.anthropic("/v1/messages", &json!({"model": "claude-x", "max_tokens": 40, "temperature": 0, "messages": question})).await;
    let text = text_of(free["content"].as_array().unwrap());
    // A stop sequence from the middle of the free answer ends it there.
    let words: Vec<&str> = text.split_whitespace().collect();
    assert!(words.len() >= 3, "{text}");
    let stop = words[2].to_string();
    let (status, stopped) = s.anthropic("/v1/messages", &json!({"model": "claude-x", "max_tokens": 40, "temperature": 0, "messages": question, "stop_sequences": ["never-generated", stop]})).await;
    assert_eq!(status, 200, "{stopped}");
    assert_eq!(stopped["stop_reason"], "stop_sequence", "{stopped}");
    assert_eq!(stopped["stop_sequence"], stop);
    let cut = text_of(stopped["content"].as_array().unwrap());
    assert!(text.starts_with(&cut) && !cut.contains(&stop), "{cut:?} of {text:?}");
    let events = s.anthropic_stream(&json!({"model": "claude-x", "max_tokens": 40, "temperature": 0, "messages": question, "stop_sequences": [stop], "stream": true})).await;
    let (blocks, delta) = streamed_message(&events);
    assert_eq!(text_of(&blocks), cut);
    assert_eq!(delta["delta"]["stop_sequence"], stop);

    // A last assistant turn is a prefill: the answer continues it, as chat's greedy text
    // continues from the same point.
    let prefill = words[..2].join(" ");
    let (status, cont) = s.anthropic("/v1/messages", &json!({"model": "claude-x", "max_tokens": 10, "temperature": 0, "messages": [question[0], {"role": "assistant", "content": prefill}]})).await;
    assert_eq!(status, 200, "{cont}");
    let more = text_of(cont["content"].as_array().unwrap());
    assert!(!more.is_empty() && !more.starts_with(&prefill), "{more:?}");

    // A long conversation of real text in consecutive same-role turns (merged) fills most
    // of the context; count_tokens and the answer's usage agree.
    let corpus = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/prima-cpp-excerpt.txt")).unwrap();
    let paragraphs: Vec<&str> = corpus.split("\n\n").filter(|p| !p.trim().is_empty()).collect();
    let mut messages = Vec::new();
    let mut counted = 0;
    for (i, p) in paragraphs.iter().cycle().enumerate() {
        let role = if (i / 2) % 2 == 0 { "user" } else { "assistant" };
        let mut next = messages.clone();
        next.push(json!({"role": role, "content": [{"type": "text", "text": p}]}));
        let (status, c) = s.anthropic("/v1/messages/count_tokens", &json!({"model": "claude-x", "messages": next})).await;
        if status != 200 || c["input_tokens"].as_u64().unwrap() > 900 {
            break;
        }
        counted = c["input_tokens"].as_u64().unwrap();
        messages = next;
    }
    assert!(counted > 600, "{counted}");
    if messages.last().unwrap()["role"] == "assistant" {
        messages.push(json!({"role": "user", "content": "Summarise."}));
        let (_, c) = s.anthropic("/v1/messages/count_tokens", &json!({"model": "claude-x", "messages": messages})).await;
        counted = c["input_tokens"].as_u64().unwrap();
    }
    let (status, long) = s.anthropic("/v1/messages", &json!({"model": "claude-x", "max_tokens": 8, "messages": messages})).await;
    assert_eq!(status, 200, "{long}");
    let u = &long["usage"];
    assert_eq!(u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap(), counted);

    // Past the context: Anthropic's own wording, which Claude Code acts on.
    let mut over = messages.clone();
    over.push(json!({"role": "assistant", "content": corpus}));
    over.push(json!({"role": "user", "content": corpus}));
    let (status, err) = s.anthropic("/v1/messages", &json!({"model": "claude-x", "max_tokens": 8, "messages": over})).await;
    assert_eq!(status, 400, "{err}");
    assert_eq!(err["type"], "error");
    assert_eq!(err["error"]["type"], "invalid_request_error");
    let m = err["error"]["message"].as_str().unwrap();
    assert!(m.starts_with("prompt is too long: ") && m.contains(" tokens > 1023 maximum; this model's maximum context length is 1024 tokens"), "{m}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_tool_use_round_trip_whole_and_streamed() {
    let s = start().await;
    let tools = json!([{"name": "get_weather", "description": "Current weather in a city", "input_schema": serde_json::from_str::<Value>(WEATHER_SCHEMA).unwrap()}]);
    let ask = json!({"role": "user", "content": "What is the weather in Oslo?"});
    let body = json!({"model": "claude-x", "max_tokens": 60, "temperature": 0, "messages": [ask], "tools": tools, "tool_choice": {"type": "any", "disable_parallel_tool_use": true}});
    let (status, msg) = s.anthropic("/v1/messages", &body).await;
    assert_eq!(status, 200, "{msg}");
    assert_eq!(msg["stop_reason"], "tool_use", "{msg}");
    let calls: Vec<&Value> = msg["content"].as_array().unwrap().iter().filter(|b| b["type"] == "tool_use").collect();
    assert_eq!(calls.len(), 1, "{msg}");
    let call = calls[0];
    assert!(call["id"].as_str().unwrap().starts_with("toolu_"));
    assert_eq!(call["name"], "get_weather");
    assert!(call["input"]["city"].is_string(), "{call}");

    // Streamed: the tool_use block starts with an empty input, whose JSON follows.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["tool_choice"] = json!({"type": "tool", "name": "get_weather"});
    let events = s.anthropic_stream(&streamed).await;
    let start = events.iter().find(|e| e.0 == "content_block_start" && e.1["content_block"]["type"] == "tool_use").expect("a tool_use block");
    assert_eq!(start.1["content_block"]["input"], json!({}));
    let (blocks, delta) = streamed_message(&events);
    assert_eq!(delta["delta"]["stop_reason"], "tool_use");
    let streamed_call = blocks.iter().find(|b| b["type"] == "tool_use").unwrap();
    assert_eq!(streamed_call["input"], call["input"]);

    // The result goes back as a tool_result (with nested content and is_error); the model
    // answers in text when it may not call tools.
    for is_error in [false, true] {
        let messages = json!([ask, {"role": "assistant", "content": [call]}, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "is_error": is_error, "content": [{"type": "text", "text": "{\"temperature\": 21, \"sky\": \"clear\"}"}]}]}]);
        let (status, answer) = s.anthropic("/v1/messages", &json!({"model": "claude-x", "max_tokens": 30, "temperature": 0, "messages": messages, "tools": tools, "tool_choice": {"type": "none"}})).await;
        assert_eq!(status, 200, "{answer}");
        assert!(!text_of(answer["content"].as_array().unwrap()).is_empty(), "{answer}");
        assert_ne!(answer["stop_reason"], "tool_use");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_errors_have_anthropic_envelopes() {
    let s = start().await;
    let ok = json!({"model": "claude-x", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]});
    let cases = [
        (json!({"model": "claude-x", "messages": [{"role": "user", "content": "hi"}]}), 400, "invalid_request_error", "max_tokens"),
        (json!({"model": "gpt-nothing", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}), 404, "not_found_error", "gpt-nothing"),
        (json!({"model": "claude-x", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}), 400, "invalid_request_error", "images"),
        (json!({"model": "claude-x", "max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "hi"}]}), 400, "invalid_request_error", "temperature"),
        (json!({"model": "claude-x", "max_tokens": 5, "messages": []}), 400, "invalid_request_error", "messages"),
        (json!({"model": "claude-x", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "web_search_20250305", "name": "web_search"}]}), 400, "invalid_request_error", "server tools"),
        (json!({"model": "claude-x", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}), 400, "invalid_request_error", "document"),
    ];
    for (body, status, kind, says) in cases {
        let (got, err) = s.anthropic("/v1/messages", &body).await;
        assert_eq!(got, status, "{body} -> {err}");
        assert_eq!(err["type"], "error", "{err}");
        assert_eq!(err["error"]["type"], kind, "{err}");
        assert!(err["error"]["message"].as_str().unwrap().contains(says), "{err}");
    }
    // Malformed JSON, a wrong key, none: Anthropic's envelope too.
    let r = s.client.post(format!("{}/v1/messages", s.base)).header("x-api-key", KEY).header("content-type", "application/json").body("{").send().await.unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["type"], "invalid_request_error");
    for key in [Some("wrong"), None] {
        let mut r = s.client.post(format!("{}/v1/messages", s.base)).json(&ok);
        if let Some(k) = key {
            r = r.header("x-api-key", k);
        }
        let r = r.send().await.unwrap();
        assert_eq!(r.status(), 401);
        let err: Value = r.json().await.unwrap();
        assert_eq!((err["type"].as_str(), err["error"]["type"].as_str()), (Some("error"), Some("authentication_error")), "{err}");
    }
    // The Bearer form of the key works too (Claude Code's ANTHROPIC_AUTH_TOKEN).
    let r = s.client.post(format!("{}/v1/messages", s.base)).bearer_auth(KEY).json(&ok).send().await.unwrap();
    assert_eq!(r.status(), 200);
    // OpenAI's routes keep OpenAI's envelope.
    let r = s.client.post(format!("{}/v1/chat/completions", s.base)).bearer_auth(KEY).json(&json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]})).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], "model_not_found");
    // Claude Code's preflight.
    let r = s.client.head(&s.base).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

impl Server {
    /// A POST the way Ollama's clients send it (Bearer key); NDJSON answers come back as
    /// their lines.
    async fn ollama(&self, path: &str, body: &Value) -> (u16, Vec<Value>) {
        let r = self.client.post(format!("{}{path}", self.base)).bearer_auth(KEY).json(body).send().await.unwrap();
        let status = r.status().as_u16();
        let ndjson = r.headers().get("content-type").is_some_and(|c| c.to_str().unwrap().starts_with("application/x-ndjson"));
        let text = r.text().await.unwrap();
        if ndjson {
            assert!(text.ends_with('\n'), "{text:?}");
            (status, text.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not a JSON line ({e}): {l}"))).collect())
        } else {
            (status, vec![serde_json::from_str(&text).unwrap_or(Value::Null)])
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ollama_chat_and_generate_say_what_chat_says_as_ndjson() {
    let s = start().await;
    let question = "What is the capital of France?";
    let chat = s.chat(&json!({"model": "", "messages": [{"role": "user", "content": question}], "max_tokens": 24, "temperature": 0})).await;
    let want = chat["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let tags: Value = s.client.get(format!("{}/api/tags", s.base)).bearer_auth(KEY).send().await.unwrap().json().await.unwrap();
    let model = tags["models"][0]["model"].as_str().unwrap().to_string();
    assert!(model.ends_with(":latest"), "{tags}");
    // Ollama's default repeat_penalty is 1.1; chat completions have none.
    let options = json!({"temperature": 0, "num_predict": 24, "repeat_penalty": 1.0});
    let body = json!({"model": model, "messages": [{"role": "user", "content": question}], "options": options, "keep_alive": -1});
    // Streamed by default, as Ollama does.
    let (status, lines) = s.ollama("/api/chat", &body).await;
    assert_eq!(status, 200);
    let last = lines.last().unwrap();
    assert_eq!(last["done"], true, "{last}");
    assert!(lines[..lines.len() - 1].iter().all(|l| l["done"] == false && l["message"]["role"] == "assistant"));
    let text: String = lines.iter().map(|l| l["message"]["content"].as_str().unwrap()).collect();
    assert_eq!(text, want);
    assert_eq!(last["eval_count"], chat["usage"]["completion_tokens"]);
    assert_eq!(last["prompt_eval_count"], chat["usage"]["prompt_tokens"]);
    let want_reason = if chat["choices"][0]["finish_reason"] == "length" { "length" } else { "stop" };
    assert_eq!(last["done_reason"], want_reason);
    for key in ["total_duration", "load_duration", "prompt_eval_duration", "eval_duration"] {
        assert!(last[key].is_u64(), "{key}: {last}");
    }
    let mut whole = body.clone();
    whole["stream"] = json!(false);
    let (_, one) = s.ollama("/api/chat", &whole).await;
    assert_eq!((one[0]["message"]["content"].as_str(), one[0]["done"].as_bool()), (Some(want.as_str()), Some(true)), "{one:?}");
    // Generate through the template gives the same text; the bare id names the model too.
    let (_, g) = s.ollama("/api/generate", &json!({"model": model.trim_end_matches(":latest"), "prompt": question, "options": options, "stream": false})).await;
    assert_eq!(g[0]["response"], want.as_str());
    // Whole answers split their time at the first token as streamed ones do (Open WebUI's
    // tokens per second is eval_count / eval_duration).
    for end in [&one[0], &g[0], last] {
        let (total, prompt, eval) = (end["total_duration"].as_u64().unwrap(), end["prompt_eval_duration"].as_u64().unwrap(), end["eval_duration"].as_u64().unwrap());
        assert!(eval > 0 && prompt < total && prompt + eval == total, "{end}");
    }

    // A long conversation near the context, in Home Assistant's shape.
    let corpus = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/prima-cpp-excerpt.txt")).unwrap();
    let mut messages = vec![json!({"role": "system", "content": "You answer questions about the text."})];
    for p in corpus.split("\n\n").filter(|p| !p.trim().is_empty()) {
        messages.push(json!({"role": "user", "content": p}));
        messages.push(json!({"role": "assistant", "content": "Noted."}));
        if messages.len() > 14 {
            break;
        }
    }
    messages.push(json!({"role": "user", "content": "Summarise."}));
    let (status, lines) = s.ollama("/api/chat", &json!({"model": model, "messages": messages, "options": {"num_predict": 8, "num_ctx": 1024}})).await;
    if status == 200 {
        assert!(lines.last().unwrap()["prompt_eval_count"].as_u64().unwrap() > 300, "{:?}", lines.last());
    } else {
        // Past the context: a clear 400 in Ollama's envelope.
        assert_eq!(status, 400);
        assert!(lines[0]["error"].as_str().unwrap().contains("context"), "{lines:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ollama_errors_and_model_listing() {
    let s = start().await;
    // The version needs no key; the rest does.
    let v: Value = s.client.get(format!("{}/api/version", s.base)).send().await.unwrap().json().await.unwrap();
    assert!(v["version"].is_string());
    let r = s.client.get(format!("{}/api/tags", s.base)).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert!(r.json::<Value>().await.unwrap()["error"].is_string());
    let (status, shown) = s.ollama("/api/show", &json!({"name": "SmolLM2-135M-Instruct.Q4_1"})).await;
    assert_eq!(status, 200, "{shown:?}");
    assert_eq!(shown[0]["model_info"]["general.architecture"], "llama");
    assert_eq!(shown[0]["details"]["quantization_level"], "Q4_1");
    assert!(shown[0]["capabilities"].as_array().unwrap().contains(&json!("tools")));
    let ps: Value = s.client.get(format!("{}/api/ps", s.base)).bearer_auth(KEY).send().await.unwrap().json().await.unwrap();
    assert_eq!(ps["models"][0]["context_length"], 1024);
    let cases = [
        ("/api/chat", json!({"model": "llama3.2:latest", "messages": [{"role": "user", "content": "hi"}]}), 404),
        ("/api/show", json!({"model": "llama3.2"}), 404),
        ("/api/pull", json!({"model": "llama3.2"}), 404),
        ("/api/chat", json!({"model": "", "messages": [{"role": "robot", "content": "hi"}]}), 400),
        ("/api/chat", json!({"model": "", "messages": [{"role": "user", "content": "hi"}], "options": {"num_ctx": 100000}}), 400),
        ("/api/chat", json!({"model": "", "messages": [{"role": "user", "content": "hi"}], "format": 5}), 400),
        ("/api/chat", json!({"model": "", "messages": [{"role": "user", "content": "hi"}], "think": "very"}), 400),
        ("/api/generate", json!({"model": "", "prompt": "hi", "images": ["AAAA"]}), 400),
        ("/api/chat", json!({"model": "", "messages": "hi"}), 400),
    ];
    for (path, body, want) in cases {
        let (status, lines) = s.ollama(path, &body).await;
        assert_eq!(status, want, "{path} {body} -> {lines:?}");
        assert_eq!(lines.len(), 1);
        let e = lines[0].as_object().unwrap();
        assert!(e.len() == 1 && e["error"].as_str().is_some_and(|m| !m.is_empty()), "{lines:?}");
    }
    // Empty requests load the model.
    let (status, lines) = s.ollama("/api/chat", &json!({"model": "", "messages": []})).await;
    assert_eq!((status, lines[0]["done_reason"].as_str()), (200, Some("load")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_detokenize_and_the_model_list() {
    let s = start().await;
    let post = |path: &'static str, body: Value| {
        let r = s.client.post(format!("{}{path}", s.base)).bearer_auth(KEY).json(&body).send();
        async move {
            let r = r.await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let text = "Hello <|im_start|> wörld";
    let (status, plain) = post("/tokenize", json!({"content": text})).await;
    assert_eq!(status, 200, "{plain}");
    let ids: Vec<i64> = plain["tokens"].as_array().unwrap().iter().map(|t| t.as_i64().unwrap()).collect();
    // The same tokens the server prompts with: <|im_start|> is one control token.
    let im_start = s.state.tokenizer.tokenize("<|im_start|>", true);
    assert!(ids.contains(&(im_start[im_start.len() - 1] as i64)), "{ids:?}");
    let (_, unparsed) = post("/tokenize", json!({"content": text, "parse_special": false})).await;
    assert!(unparsed["tokens"].as_array().unwrap().len() > ids.len());
    let (_, back) = post("/detokenize", json!({"tokens": ids})).await;
    assert_eq!(back["content"], text);
    let (_, pieces) = post("/tokenize", json!({"content": ["Hi", 42, " there"], "with_pieces": true})).await;
    let pieces = pieces["tokens"].as_array().unwrap();
    assert!(pieces.iter().any(|p| p["id"] == 42), "{pieces:?}");
    assert!(pieces.iter().all(|p| p["piece"].is_string() || p["piece"].is_array()));
    // Ids outside the vocabulary never reach llama.cpp.
    for (path, body) in [("/detokenize", json!({"tokens": [1, -1]})), ("/detokenize", json!({"tokens": [1u64 << 40]})), ("/tokenize", json!({"content": ["a", 49152]}))] {
        let (status, err) = post(path, body).await;
        assert_eq!(status, 400, "{err}");
        assert!(err["error"]["message"].as_str().unwrap().contains("vocabulary"), "{err}");
    }
    let models: Value = s.client.get(format!("{}/v1/models", s.base)).bearer_auth(KEY).send().await.unwrap().json().await.unwrap();
    let card = &models["data"][0];
    assert_eq!(card["context_length"], 1024);
    assert!(card["capabilities"].as_array().unwrap().contains(&json!("chat")), "{card}");
}

/// A streamed response as (event name, data), each frame named and numbered in order.
async fn response_events(s: &Server, body: &Value) -> Vec<(String, Value)> {
    let r = s.client.post(format!("{}/v1/responses", s.base)).bearer_auth(KEY).json(body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    let events: Vec<(String, Value)> = text
        .split("\n\n")
        .filter(|f| !f.trim().is_empty() && !f.starts_with(':'))
        .map(|f| {
            let name = f.lines().find_map(|l| l.strip_prefix("event: ")).unwrap().to_string();
            let data: Value = serde_json::from_str(f.lines().find_map(|l| l.strip_prefix("data: ")).unwrap()).unwrap();
            assert_eq!(data["type"], name.as_str());
            (name, data)
        })
        .collect();
    for (i, (_, d)) in events.iter().enumerate() {
        assert_eq!(d["sequence_number"], i as u64, "{events:?}");
    }
    events
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_say_what_chat_says_with_indexed_events_and_a_bounded_store() {
    let s = start().await;
    let question = "What is the capital of France?";
    let chat = s.chat(&json!({"model": "", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}], "max_tokens": 20, "temperature": 0})).await;
    let want = chat["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let body = json!({"model": "", "input": [{"role": "user", "content": question}], "instructions": "Be brief.", "max_output_tokens": 20, "temperature": 0});
    let r = s.client.post(format!("{}/v1/responses", s.base)).bearer_auth(KEY).json(&body).send().await.unwrap();
    let whole: Value = r.json().await.unwrap();
    let texts: Vec<&str> = whole["output"].as_array().unwrap().iter().filter(|o| o["type"] == "message").flat_map(|o| o["content"].as_array().unwrap()).map(|c| c["text"].as_str().unwrap()).collect();
    assert_eq!(texts.concat(), want, "{whole}");
    assert_eq!(whole["usage"]["input_tokens"], chat["usage"]["prompt_tokens"]);
    let want_status = if chat["choices"][0]["finish_reason"] == "length" { "incomplete" } else { "completed" };
    assert_eq!(whole["status"], want_status);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = response_events(&s, &streamed).await;
    let names: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(&names[..5], ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added", "response.output_text.delta"], "{names:?}");
    let tail = &names[names.len() - 4..];
    assert_eq!(tail, ["response.output_text.done", "response.content_part.done", "response.output_item.done", &format!("response.{want_status}")[..]], "{names:?}");
    let deltas: String = events.iter().filter(|e| e.0 == "response.output_text.delta").map(|e| e.1["delta"].as_str().unwrap()).collect();
    assert_eq!(deltas, want);
    assert!(events.iter().filter(|e| e.0.contains("output_text")).all(|e| e.1["output_index"] == 0 && e.1["content_index"] == 0));
    let done = &events.last().unwrap().1["response"];
    let id = done["id"].as_str().unwrap();
    // Kept: retrievable, then deleted.
    let got: Value = s.client.get(format!("{}/v1/responses/{id}", s.base)).bearer_auth(KEY).send().await.unwrap().json().await.unwrap();
    assert_eq!(got["output"], done["output"]);
    let del = s.client.delete(format!("{}/v1/responses/{id}", s.base)).bearer_auth(KEY).send().await.unwrap();
    assert_eq!(del.status(), 200);
    let gone = s.client.get(format!("{}/v1/responses/{id}", s.base)).bearer_auth(KEY).send().await.unwrap();
    assert_eq!(gone.status(), 404);
    assert_eq!(gone.json::<Value>().await.unwrap()["error"]["code"], "response_not_found");

    // A function call streams as one item with its whole arguments.
    let tools = json!([{"type": "function", "name": "get_weather", "parameters": serde_json::from_str::<Value>(WEATHER_SCHEMA).unwrap()}]);
    let events = response_events(&s, &json!({"model": "", "input": "What is the weather in Oslo?", "tools": tools, "tool_choice": {"type": "function", "name": "get_weather"}, "stream": true, "max_output_tokens": 60, "temperature": 0})).await;
    let args = events.iter().find(|e| e.0 == "response.function_call_arguments.done").expect("a function call");
    assert!(serde_json::from_str::<Value>(args.1["arguments"].as_str().unwrap()).unwrap()["city"].is_string());
    let item = events.iter().rev().find(|e| e.0 == "response.output_item.done").unwrap();
    assert_eq!(item.1["item"]["type"], "function_call");
    assert_eq!(item.1["output_index"], args.1["output_index"]);
    // Refusals: images, background, item references, unknown previous ids.
    for (input, extra, param) in [
        (json!([{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]), json!({}), "input[0].content[0]"),
        (json!("hi"), json!({"background": true}), "background"),
        (json!([{"type": "item_reference", "id": "msg_1"}]), json!({}), "input[0]"),
        (json!("hi"), json!({"previous_response_id": "resp_nope"}), "previous_response_id"),
    ] {
        let mut b = json!({"model": "", "input": input});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let r = s.client.post(format!("{}/v1/responses", s.base)).bearer_auth(KEY).json(&b).send().await.unwrap();
        assert_eq!(r.status(), 400, "{b}");
        assert_eq!(r.json::<Value>().await.unwrap()["error"]["param"], param, "{b}");
    }
}

/// A system prompt long enough that reusing it shows (a few hundred tokens).
fn long_system_prompt() -> String {
    let corpus = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/prima-cpp-excerpt.txt")).unwrap();
    let mut text = String::from("You are a coding agent. Read the notes below.\n\n");
    for p in corpus.split("\n\n").filter(|p| !p.trim().is_empty()) {
        if text.len() > 1500 {
            break;
        }
        text.push_str(p);
        text.push_str("\n\n");
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_system_turns_and_claude_codes_billing_header() {
    let s = start().await;
    let count = |body: Value| {
        let s = &s;
        async move {
            let (status, counted) = s.anthropic("/v1/messages/count_tokens", &body).await;
            assert_eq!(status, 200, "{body}: {counted}");
            counted["input_tokens"].as_u64().unwrap()
        }
    };
    let user = json!({"role": "user", "content": "What is the capital of France?"});
    // A system turn first in `messages` is the system prompt, whether sent so or in `system`.
    let plain = count(json!({"model": "claude-x", "messages": [user]})).await;
    let as_turn = count(json!({"model": "claude-x", "messages": [{"role": "system", "content": "Answer in French."}, user]})).await;
    let as_field = count(json!({"model": "claude-x", "system": "Answer in French.", "messages": [user]})).await;
    assert_eq!(as_turn, as_field);
    // (SmolLM2's template writes its own default system prompt when there is none.)
    assert_ne!(as_turn, plain);
    let with_both = count(json!({"model": "claude-x", "system": "Be brief.", "messages": [{"role": "system", "content": [{"type": "text", "text": "Answer in French."}]}, user]})).await;
    assert!(with_both > as_field, "the system turn joins the system prompt: {with_both} vs {as_field}");
    // Later, after a user turn (Anthropic's mid-conversation system message): kept in place.
    let later = count(json!({"model": "claude-x", "system": "Be brief.", "messages": [user, {"role": "system", "content": "Answer in French."}]})).await;
    let without = count(json!({"model": "claude-x", "system": "Be brief.", "messages": [user]})).await;
    assert!(later > without, "{later} vs {without}");
    let (status, msg) = s.anthropic("/v1/messages", &json!({"model": "claude-x", "max_tokens": 8, "temperature": 0, "messages": [{"role": "system", "content": "Answer in French."}, user, {"role": "system", "content": "Be brief."}]})).await;
    assert_eq!(status, 200, "{msg}");
    assert_eq!(msg["type"], "message");
    // A system turn holds text only.
    let (status, err) = s.anthropic("/v1/messages", &json!({"model": "claude-x", "max_tokens": 8, "messages": [user, {"role": "system", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": {}}]}]})).await;
    assert_eq!((status, err["error"]["type"].as_str()), (400, Some("invalid_request_error")), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_claude_codes_billing_header_keeps_the_system_prompt_cached() {
    let s = start().await;
    let count = |body: Value| {
        let s = &s;
        async move {
            let (status, counted) = s.anthropic("/v1/messages/count_tokens", &body).await;
            assert_eq!(status, 200, "{body}: {counted}");
            counted["input_tokens"].as_u64().unwrap()
        }
    };
    let user = json!({"role": "user", "content": "What is the capital of France?"});
    // Claude Code's billing header block is not part of the prompt, so two conversations
    // whose headers differ share the whole system prompt in the cache.
    let system = long_system_prompt();
    let header = |cch: &str| json!({"type": "text", "text": format!("x-anthropic-billing-header: cc_version=2.1.3.{cch}; cc_entrypoint=cli; cch={cch};")});
    let blocks = |cch: &str| json!([header(cch), {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]);
    let counted = count(json!({"model": "claude-x", "system": blocks("a1b2c"), "messages": [user]})).await;
    assert!(counted > 200, "{counted}");
    let mut cached = Vec::new();
    for cch in ["a1b2c", "d3e4f"] {
        let (status, msg) = s.anthropic("/v1/messages", &json!({"model": "claude-x", "max_tokens": 4, "temperature": 0, "system": blocks(cch), "messages": [user]})).await;
        assert_eq!(status, 200, "{msg}");
        let u = &msg["usage"];
        assert_eq!(u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap(), counted, "{u}");
        cached.push(u["cache_read_input_tokens"].as_u64().unwrap());
    }
    // Reuse ends on a whole tile (64 tokens) at least a tile before the prompt's end, so
    // that the rest is computed as a cold prompt computes it.
    assert!(cached[1] + 2 * 64 >= counted, "the second conversation reuses the system prompt: {cached:?} of {counted}");
    // Dropped, not moved: the prompt is the one without the header.
    assert_eq!(counted, count(json!({"model": "claude-x", "system": system, "messages": [user]})).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_message_start_reports_the_cached_split() {
    let s = start().await;
    let body = json!({"model": "claude-x", "max_tokens": 6, "temperature": 0, "stream": true, "system": long_system_prompt(), "messages": [{"role": "user", "content": "Summarise."}]});
    let mut starts = Vec::new();
    for _ in 0..2 {
        let events = s.anthropic_stream(&body).await;
        let (_, delta) = streamed_message(&events);
        let start = events[0].1["message"]["usage"].clone();
        // message_start says what message_delta says: the same split of the prompt.
        for key in ["input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"] {
            assert_eq!(start[key], delta["usage"][key], "{key}: {start} vs {}", delta["usage"]);
        }
        starts.push(start);
    }
    let again = &starts[1];
    assert!(again["cache_read_input_tokens"].as_u64().unwrap() > 200, "the second request reuses the prompt: {again}");
    assert_eq!(
        again["input_tokens"].as_u64().unwrap() + again["cache_read_input_tokens"].as_u64().unwrap(),
        starts[0]["input_tokens"].as_u64().unwrap() + starts[0]["cache_read_input_tokens"].as_u64().unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_offer_namespace_functions_and_call_them_with_their_namespace() {
    let s = start().await;
    // Codex's sub-agent tools come as a namespace of functions.
    let schema = json!({"type": "object", "properties": {"task": {"type": "string", "maxLength": 40}}, "required": ["task"], "additionalProperties": false});
    let tools = json!([{"type": "namespace", "name": "collaboration", "description": "Work with sub-agents.", "tools": [
        {"type": "function", "name": "spawn_agent", "description": "Start a sub-agent on a task.", "strict": false, "parameters": schema}
    ]}]);
    let body = json!({"model": "", "input": "Start a sub-agent that lists the files.", "tools": tools, "tool_choice": "required", "max_output_tokens": 120, "temperature": 0});
    let r = s.client.post(format!("{}/v1/responses", s.base)).bearer_auth(KEY).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let whole: Value = r.json().await.unwrap();
    let call = whole["output"].as_array().unwrap().iter().find(|o| o["type"] == "function_call").unwrap_or_else(|| panic!("a function call: {whole}")).clone();
    assert_eq!((call["name"].as_str(), call["namespace"].as_str()), (Some("spawn_agent"), Some("collaboration")), "{call}");
    assert!(serde_json::from_str::<Value>(call["arguments"].as_str().unwrap()).unwrap()["task"].is_string(), "{call}");
    // Streamed, the item says the same.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = response_events(&s, &streamed).await;
    let done = events.iter().rev().find(|e| e.0 == "response.output_item.done").unwrap();
    assert_eq!((done.1["item"]["name"].as_str(), done.1["item"]["namespace"].as_str()), (Some("spawn_agent"), Some("collaboration")), "{:?}", done.1);
    // Codex sends the call back with its namespace, and the result after it.
    let input = json!([
        {"role": "user", "content": "Start a sub-agent that lists the files."},
        {"type": "function_call", "call_id": "call_1", "name": "spawn_agent", "namespace": "collaboration", "arguments": call["arguments"]},
        {"type": "function_call_output", "call_id": "call_1", "output": "agent started"}
    ]);
    let r = s.client.post(format!("{}/v1/responses", s.base)).bearer_auth(KEY).json(&json!({"model": "", "input": input, "tools": tools, "max_output_tokens": 8, "temperature": 0})).send().await.unwrap();
    assert_eq!(r.status(), 200);
}
