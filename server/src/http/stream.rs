//! The one writer of generation streams, for every API that streams: as server-sent events
//! (chat and text completions, Anthropic Messages) or as NDJSON lines (Ollama). It merges
//! the choices' event streams, counts the usage (with cached prompt tokens) until every
//! choice has finished, and ends the stream after a failure; SSE gets keep-alives. What
//! differs — the frames themselves, whether the opening waits for the prompt to be
//! processed, how a stream closes and how a failure reads — comes from the endpoint's
//! `Chunks`.

use std::convert::Infallible;

use axum::body::Body;
use axum::http::header;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use openapi::{PromptTokensDetails, Usage};
use tokio::sync::mpsc::UnboundedReceiver;

use super::error::ApiError;
use super::generate;
use crate::runtime::generation::{Event, Finish, TokenInfo};

/// An endpoint's chunks. Indices are choice indices.
pub trait Chunks: Send + 'static {
    /// An SSE event or an NDJSON line.
    type Frame: Send + 'static;
    /// What goes out before any token (chat: each choice's role; completions: echoes).
    fn opening(&mut self) -> Vec<Self::Frame>;
    /// Whether `opening` waits until every choice's prompt is processed, and so carries
    /// how many prompt tokens came from the cache (`cached`, told just before): Anthropic's
    /// `message_start` reports the usage's split, which the batcher knows only then. Any
    /// other event (a failure, an answer with nothing to generate) opens at once.
    fn opens_after_start(&self) -> bool {
        false
    }
    /// The prompt tokens reused from the cache (the most any choice reused), before a
    /// waiting `opening`.
    fn cached(&mut self, _cached_tokens: usize) {}
    /// New text of choice `i`, with its log-probabilities when asked for.
    fn text(&mut self, i: usize, text: String, info: Option<TokenInfo>) -> Vec<Self::Frame>;
    /// Choice `i` ended: what it still held back, then its finish chunk.
    fn finish(&mut self, i: usize, finish: Finish) -> Vec<Self::Frame>;
    /// Every choice has finished: what closes the stream (OpenAI: the usage chunk when
    /// asked for, then `data: [DONE]`).
    fn done(&mut self, usage: Usage) -> Vec<Self::Frame>;
    /// Generation failed after the stream began: the status line has gone out already, so
    /// the error travels in the stream (OpenAI: its envelope, then `data: [DONE]`).
    fn failure(&mut self, e: &ApiError) -> Vec<Self::Frame>;
}

/// OpenAI's failure mid-stream: its envelope, then `data: [DONE]`.
pub fn openai_failure(e: &ApiError) -> Vec<SseEvent> {
    vec![data(&e.body()), SseEvent::default().data("[DONE]")]
}

/// OpenAI's close: the usage chunk (when asked for), then `data: [DONE]`.
pub fn openai_done(usage_chunk: Option<SseEvent>) -> Vec<SseEvent> {
    usage_chunk.into_iter().chain([SseEvent::default().data("[DONE]")]).collect()
}

/// A chunk serialized as one `data:` event.
pub fn data(chunk: &impl serde::Serialize) -> SseEvent {
    SseEvent::default().data(serde_json::to_string(chunk).unwrap_or_default())
}

/// A frame as one event named on its `event:` line by its `type` (Anthropic's and the
/// Responses API's events: their SDKs route on the name).
pub fn named(frame: &impl serde::Serialize) -> SseEvent {
    let data = serde_json::to_value(frame).unwrap_or_default();
    let name = data["type"].as_str().unwrap_or("error").to_string();
    SseEvent::default().event(name).data(data.to_string())
}

/// The usage of a request: prompt tokens of every prompt, generated tokens of every choice,
/// and how many prompt tokens came from the cache (the most any choice reused).
pub fn usage(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Usage {
    Usage { prompt_tokens_details: Some(PromptTokensDetails { cached_tokens: cached_tokens as u32 }), ..Usage::new(prompt_tokens as u32, completion_tokens as u32) }
}

/// Streams the choices' events as server-sent events.
pub fn sse(receivers: Vec<UnboundedReceiver<Event>>, prompt_tokens: usize, chunks: impl Chunks<Frame = SseEvent>) -> Response {
    let events = frames(receivers, prompt_tokens, chunks).map(Ok::<_, Infallible>);
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

/// Streams the choices' events as NDJSON: one JSON object per line.
pub fn ndjson(receivers: Vec<UnboundedReceiver<Event>>, prompt_tokens: usize, chunks: impl Chunks<Frame = serde_json::Value>) -> Response {
    let lines = frames(receivers, prompt_tokens, chunks).map(|v| Ok::<_, Infallible>(format!("{v}\n")));
    ([(header::CONTENT_TYPE, "application/x-ndjson")], Body::from_stream(lines)).into_response()
}

/// The frames `chunks` renders of the choices' events, in arrival order.
fn frames<C: Chunks>(receivers: Vec<UnboundedReceiver<Event>>, prompt_tokens: usize, mut chunks: C) -> impl futures::Stream<Item = C::Frame> + Send {
    let n = receivers.len();
    let mut opened = !chunks.opens_after_start();
    let opening = if opened { chunks.opening() } else { Vec::new() };
    let (mut completion, mut cached, mut started, mut finished, mut ended) = (0, 0, 0, 0, false);
    let body = generate::merged(receivers).flat_map(move |(i, event)| {
        let mut out = Vec::new();
        // After a failure the stream is over: the other choices' events are dropped.
        if ended {
            return futures::stream::iter(out);
        }
        if let Event::Started { cached_tokens } = &event {
            cached = cached.max(*cached_tokens);
            started += 1;
        }
        if !opened && (started == n || !matches!(event, Event::Started { .. })) {
            chunks.cached(cached);
            out.extend(chunks.opening());
            opened = true;
        }
        match event {
            Event::Started { .. } => {}
            Event::Token { text, info } => out.extend(chunks.text(i, text, info)),
            Event::Done { finish, completion_tokens } => {
                completion += completion_tokens;
                finished += 1;
                out.extend(chunks.finish(i, finish));
                if finished == n {
                    out.extend(chunks.done(usage(prompt_tokens, completion, cached)));
                    ended = true;
                }
            }
            Event::Failed(m) => {
                tracing::error!("generation failed: {m}");
                out.extend(chunks.failure(&ApiError::Internal(m)));
                ended = true;
            }
            Event::Unavailable(m) => {
                out.extend(chunks.failure(&ApiError::Unavailable(m)));
                ended = true;
            }
        }
        futures::stream::iter(out)
    });
    futures::stream::iter(opening).chain(body)
}
