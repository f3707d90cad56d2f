//! The one SSE writer of generation streams, for every API that streams events (chat and
//! text completions, Anthropic Messages). It merges the choices' event streams, counts the
//! usage (with cached prompt tokens) until every choice has finished, ends the stream
//! after a failure, and sends keep-alives. What differs — the events themselves, how a
//! stream closes and how a failure reads — comes from the endpoint's `Chunks`.

use std::convert::Infallible;

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
    /// What goes out before any token (chat: each choice's role; completions: echoes).
    fn opening(&mut self) -> Vec<SseEvent>;
    /// New text of choice `i`, with its log-probabilities when asked for.
    fn text(&mut self, i: usize, text: String, info: Option<TokenInfo>) -> Vec<SseEvent>;
    /// Choice `i` ended: what it still held back, then its finish chunk.
    fn finish(&mut self, i: usize, finish: Finish) -> Vec<SseEvent>;
    /// Every choice has finished: what closes the stream (OpenAI: the usage chunk when
    /// asked for, then `data: [DONE]`).
    fn done(&mut self, usage: Usage) -> Vec<SseEvent>;
    /// Generation failed after the stream began: the status line has gone out already, so
    /// the error travels as events (OpenAI: its envelope, then `data: [DONE]`).
    fn failure(&mut self, e: &ApiError) -> Vec<SseEvent> {
        vec![data(&e.body()), SseEvent::default().data("[DONE]")]
    }
}

/// OpenAI's close: the usage chunk (when asked for), then `data: [DONE]`.
pub fn openai_done(usage_chunk: Option<SseEvent>) -> Vec<SseEvent> {
    usage_chunk.into_iter().chain([SseEvent::default().data("[DONE]")]).collect()
}

/// A chunk serialized as one `data:` event.
pub fn data(chunk: &impl serde::Serialize) -> SseEvent {
    SseEvent::default().data(serde_json::to_string(chunk).unwrap_or_default())
}

/// The usage of a request: prompt tokens of every prompt, generated tokens of every choice,
/// and how many prompt tokens came from the cache (the most any choice reused).
pub fn usage(prompt_tokens: usize, completion_tokens: usize, cached_tokens: usize) -> Usage {
    Usage { prompt_tokens_details: Some(PromptTokensDetails { cached_tokens: cached_tokens as u32 }), ..Usage::new(prompt_tokens as u32, completion_tokens as u32) }
}

/// Streams the choices' events as `chunks` renders them.
pub fn stream(receivers: Vec<UnboundedReceiver<Event>>, prompt_tokens: usize, mut chunks: impl Chunks) -> Response {
    let n = receivers.len();
    let opening = chunks.opening();
    let (mut completion, mut cached, mut finished, mut ended) = (0, 0, 0, false);
    let body = generate::merged(receivers).flat_map(move |(i, event)| {
        let mut out = Vec::new();
        // After a failure the stream is over: the other choices' events are dropped.
        if ended {
            return futures::stream::iter(out);
        }
        match event {
            Event::Started { cached_tokens } => cached = cached.max(cached_tokens),
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
    let events = futures::stream::iter(opening).chain(body).map(Ok::<_, Infallible>);
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}
