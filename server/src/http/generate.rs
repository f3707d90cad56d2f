//! Shared by the chat and completions handlers: turn one prompt into `n` generation
//! requests, then either collect their events into whole choices or merge them into one
//! ordered stream for SSE.

use std::time::Instant;

use engine::sampler::SamplingParams;
use futures::stream::{self, Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::error::ApiError;
use super::AppState;
use crate::runtime::generation::{Event, Finish, GenerationRequest, TokenInfo};

/// OpenAI's defaults for the parameters OpenAI has (an unset temperature or top_p means 1).
const DEFAULT_TEMPERATURE: f32 = 1.0;
const DEFAULT_TOP_P: f32 = 1.0;
/// llama-server's defaults for hearth's extensions: they keep small models on track.
const DEFAULT_TOP_K: i32 = 40;
const DEFAULT_MIN_P: f32 = 0.05;
/// Repetition and OpenAI's penalties are off unless asked for.
const DEFAULT_REPEAT_PENALTY: f32 = 1.0;
const DEFAULT_PENALTY: f32 = 0.0;
/// How many recent tokens the repetition penalty looks at (llama-server's default).
const REPEAT_LAST_N: i32 = 64;

/// The sampling parameters of a validated request: what the client sent, every unset one
/// at its default. The seed is set per choice.
pub fn sampling_params(sent: openapi::SamplingOptions, grammar: Option<String>) -> Result<SamplingParams, ApiError> {
    let logit_bias = match sent.logit_bias {
        Some(b) => openapi::parse_logit_bias(b)?.into_iter().map(|(t, v)| (t.min(i32::MAX as u32) as i32, v)).collect(),
        None => Vec::new(),
    };
    Ok(SamplingParams {
        temperature: sent.temperature.unwrap_or(DEFAULT_TEMPERATURE),
        top_k: sent.top_k.unwrap_or(DEFAULT_TOP_K),
        top_p: sent.top_p.unwrap_or(DEFAULT_TOP_P),
        min_p: sent.min_p.unwrap_or(DEFAULT_MIN_P),
        repeat_penalty: sent.repeat_penalty.unwrap_or(DEFAULT_REPEAT_PENALTY),
        repeat_last_n: REPEAT_LAST_N,
        frequency_penalty: sent.frequency_penalty.unwrap_or(DEFAULT_PENALTY),
        presence_penalty: sent.presence_penalty.unwrap_or(DEFAULT_PENALTY),
        seed: 0,
        logit_bias,
        grammar,
    })
}

/// What every choice of one request shares.
pub struct GenSpec {
    pub id: String,
    pub prompt: Vec<i32>,
    pub sampling: SamplingParams,
    /// Requested limit; `None` means until the context is full.
    pub max_tokens: Option<u32>,
    pub stop: Vec<String>,
    pub logprobs: Option<usize>,
    /// `Some` when the client fixed the seed: choice i uses seed + i.
    pub seed: Option<i64>,
    /// The request field the prompt came from (`messages`, `prompt`): the `param` of an
    /// error about it.
    pub prompt_field: &'static str,
}

/// Refuses prompt text that cannot fit the context whatever its tokens, before tokenizing
/// it: a 4 MiB prompt takes about 100 MB and half a second to tokenize.
pub fn check_prompt_bytes(state: &AppState, bytes: usize, field: &'static str) -> Result<(), ApiError> {
    let max = state.runtime.n_ctx();
    let at_least = state.tokenizer.min_tokens(bytes);
    if at_least >= max {
        return Err(ApiError::PromptTooLong { max, limit: max.saturating_sub(1), at_least, field });
    }
    Ok(())
}

/// Submits `n` sequences; their events arrive on the returned receivers, in choice order.
pub fn start(state: &AppState, spec: &GenSpec, n: usize) -> Result<Vec<mpsc::UnboundedReceiver<Event>>, ApiError> {
    let n_ctx = state.runtime.n_ctx();
    if spec.prompt.is_empty() {
        return Err(ApiError::InvalidParameter { param: Some(spec.prompt_field.into()), message: "the prompt is empty".into() });
    }
    if spec.prompt.len() >= n_ctx {
        return Err(ApiError::ContextLengthExceeded { max: n_ctx, limit: n_ctx - 1, prompt: spec.prompt.len(), field: spec.prompt_field });
    }
    if n > state.runtime.parallel() {
        return Err(ApiError::InvalidParameter {
            param: Some("n".into()),
            message: format!("n = {n} exceeds the {} sequences this server generates at once (--parallel)", state.runtime.parallel()),
        });
    }
    let room = n_ctx - spec.prompt.len();
    let max_tokens = spec.max_tokens.map_or(room, |m| (m as usize).min(room));
    let mut receivers = Vec::with_capacity(n);
    if max_tokens == 0 {
        // Nothing to generate (a completion that only echoes its prompt): every choice is
        // finished at once, and the engine never sees the request.
        for _ in 0..n {
            let (tx, rx) = mpsc::unbounded_channel();
            let _ = tx.send(Event::Done { finish: Finish::Length, completion_tokens: 0 });
            receivers.push(rx);
        }
        return Ok(receivers);
    }
    for i in 0..n {
        let (tx, rx) = mpsc::unbounded_channel();
        let seed = match spec.seed {
            Some(s) => (s as u64).wrapping_add(i as u64) as u32,
            None => rand_seed(),
        };
        let req = GenerationRequest {
            id: if n == 1 { spec.id.clone() } else { format!("{}/{i}", spec.id) },
            prompt: spec.prompt.clone(),
            sampling: SamplingParams { seed, ..spec.sampling.clone() },
            max_tokens,
            stop: spec.stop.clone(),
            logprobs: spec.logprobs,
            events: tx,
            enqueued: Instant::now(),
        };
        // Earlier choices already submitted are cancelled when their receivers drop.
        state.runtime.submit(req)?;
        receivers.push(rx);
    }
    Ok(receivers)
}

/// Refuses a generation request at once when the batcher would not take it (full queue,
/// shutting down, ring broken), before the request's preparation spends any CPU.
pub fn check_room(state: &AppState) -> Result<(), ApiError> {
    Ok(state.runtime.has_room()?)
}

fn rand_seed() -> u32 {
    let u = uuid::Uuid::new_v4();
    u32::from_le_bytes(u.as_bytes()[..4].try_into().expect("4 bytes"))
}

/// One finished choice.
#[derive(Debug, Default)]
pub struct Choice {
    pub text: String,
    pub tokens: Vec<TokenInfo>,
    pub finish: Option<Finish>,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    /// When the prompt was processed and generation began (Ollama's durations split there).
    pub started: Option<Instant>,
}

pub async fn collect(mut rx: mpsc::UnboundedReceiver<Event>) -> Result<Choice, ApiError> {
    let mut c = Choice::default();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Started { cached_tokens, .. } => {
                c.cached_tokens = cached_tokens;
                c.started = Some(Instant::now());
            }
            Event::Token { text, info } => {
                c.text.push_str(&text);
                c.tokens.extend(info);
            }
            Event::Done { finish, completion_tokens } => {
                c.finish = Some(finish);
                c.completion_tokens = completion_tokens;
                return Ok(c);
            }
            Event::Failed(m) => return Err(ApiError::Internal(m)),
            Event::Unavailable(m) => return Err(ApiError::Unavailable(m)),
        }
    }
    Err(ApiError::Internal("the batcher dropped a sequence".into()))
}

pub async fn collect_all(receivers: Vec<mpsc::UnboundedReceiver<Event>>) -> Result<Vec<Choice>, ApiError> {
    futures::future::try_join_all(receivers.into_iter().map(collect)).await
}

/// All choices' events as one stream of (choice index, event), in arrival order.
pub fn merged(receivers: Vec<mpsc::UnboundedReceiver<Event>>) -> impl Stream<Item = (usize, Event)> + Send {
    stream::select_all(receivers.into_iter().enumerate().map(|(i, rx)| UnboundedReceiverStream::new(rx).map(move |e| (i, e)).boxed()))
}

pub fn finish_reason(f: Finish) -> openapi::FinishReason {
    match f {
        Finish::Stop | Finish::StopString(_) => openapi::FinishReason::Stop,
        Finish::Length => openapi::FinishReason::Length,
    }
}
