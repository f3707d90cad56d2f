//! What the HTTP layer hands the batcher, and what comes back.

use std::time::Instant;

use engine::sampler::SamplingParams;
use tokio::sync::mpsc;

/// One sequence to generate: a tokenized prompt and everything that decides when and how
/// to stop. `n` choices of one HTTP request are `n` of these.
pub struct GenerationRequest {
    pub id: String,
    pub prompt: Vec<i32>,
    pub sampling: SamplingParams,
    /// Most tokens to generate (already clamped to the context left after the prompt).
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// `Some(k)`: report each token's log-probability and the `k` most likely alternatives.
    pub logprobs: Option<usize>,
    pub events: mpsc::UnboundedSender<Event>,
    pub enqueued: Instant,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// End-of-generation token.
    Stop,
    /// The request's stop string at this index in its list (not part of the text).
    StopString(usize),
    /// `max_tokens` or the context ran out.
    Length,
}

#[derive(Debug, Clone)]
pub struct TokenLogprob {
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

#[derive(Debug, Clone)]
pub struct TokenInfo {
    pub logprob: TokenLogprob,
    pub top: Vec<TokenLogprob>,
}

#[derive(Debug)]
pub enum Event {
    /// The prompt is in the cache (`cached` of its tokens were reused from an earlier
    /// request); generation starts.
    Started { cached_tokens: usize },
    /// New text, cut on UTF-8 and stop-string boundaries (may be empty when a token only
    /// completes part of a character), with the token's log-probabilities when asked.
    Token { text: String, info: Option<TokenInfo> },
    Done { finish: Finish, completion_tokens: usize },
    /// The engine failed for this sequence; the message is safe to show a client.
    Failed(String),
    /// A ring member failed or could not be reached; retrying later may work.
    Unavailable(String),
}
