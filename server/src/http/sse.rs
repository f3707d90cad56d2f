//! The one SSE writer of generation streams, for chat and text completions alike. It
//! merges the choices' event streams and owns everything the two must agree on: the
//! usage chunk (with cached prompt tokens) after every choice has finished, a failure as
//! an error event in OpenAI's envelope, `data: [DONE]` at the end, and keep-alives. What
//! differs — the chunks themselves — comes from the endpoint's `Chunks`.

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
    /// The usage chunk, which carries no choices.
    fn usage(&self, usage: Usage) -> SseEvent;
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
pub fn stream(receivers: Vec<UnboundedReceiver<Event>>, prompt_tokens: usize, include_usage: bool, mut chunks: impl Chunks) -> Response {
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
                    if include_usage {
                        out.push(chunks.usage(usage(prompt_tokens, completion, cached)));
                    }
                    out.push(SseEvent::default().data("[DONE]"));
                    ended = true;
                }
            }
            Event::Failed(m) => {
                out.extend(failure(ApiError::Internal(m)));
                ended = true;
            }
            Event::Unavailable(m) => {
                out.extend(failure(ApiError::Unavailable(m)));
                ended = true;
            }
        }
        futures::stream::iter(out)
    });
    let events = futures::stream::iter(opening).chain(body).map(Ok::<_, Infallible>);
    Sse::new(events).keep_alive(KeepAlive::default()).into_response()
}

/// A failure mid-stream: the status line has gone out already, so the error travels as
/// an event in OpenAI's envelope, then `[DONE]`.
fn failure(e: ApiError) -> [SseEvent; 2] {
    if let ApiError::Internal(detail) = &e {
        tracing::error!("generation failed: {detail}");
    }
    [data(&e.body()), SseEvent::default().data("[DONE]")]
}
