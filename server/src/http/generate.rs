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

/// The sampling fields chat and text completions share, as sent.
pub struct SamplingFields<'a> {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub logit_bias: Option<&'a std::collections::BTreeMap<String, f32>>,
}

/// The shared sampling fields of a chat or text completion request (their names match).
macro_rules! sampling_fields {
    ($req:expr) => {
        $crate::http::generate::SamplingFields {
            temperature: $req.temperature,
            top_p: $req.top_p,
            top_k: $req.top_k,
            min_p: $req.min_p,
            repeat_penalty: $req.repeat_penalty,
            frequency_penalty: $req.frequency_penalty,
            presence_penalty: $req.presence_penalty,
            logit_bias: $req.logit_bias.as_ref(),
        }
    };
}
pub(crate) use sampling_fields;

/// Unset OpenAI parameters take OpenAI's defaults (temperature 1, top_p 1); hearth's
/// extensions take llama-server's (top_k 40, min_p 0.05), which keep small models on
/// track. The seed is set per choice.
pub fn sampling_params(f: SamplingFields, grammar: Option<String>) -> Result<SamplingParams, ApiError> {
    let logit_bias = match f.logit_bias {
        Some(b) => openapi::parse_logit_bias(b)?.into_iter().map(|(t, v)| (t.min(i32::MAX as u32) as i32, v)).collect(),
        None => Vec::new(),
    };
    Ok(SamplingParams {
        temperature: f.temperature.unwrap_or(1.0),
        top_k: f.top_k.unwrap_or(40),
        top_p: f.top_p.unwrap_or(1.0),
        min_p: f.min_p.unwrap_or(0.05),
        repeat_penalty: f.repeat_penalty.unwrap_or(1.0),
        repeat_last_n: 64,
        frequency_penalty: f.frequency_penalty.unwrap_or(0.0),
        presence_penalty: f.presence_penalty.unwrap_or(0.0),
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
}

/// Refuses prompt text that cannot fit the context whatever its tokens, before tokenizing
/// it: a 4 MiB prompt takes about 100 MB and half a second to tokenize.
pub fn check_prompt_bytes(state: &AppState, bytes: usize) -> Result<(), ApiError> {
    let max = state.runtime.n_ctx();
    let at_least = state.tokenizer.min_tokens(bytes);
    if at_least >= max {
        return Err(ApiError::PromptTooLong { max, at_least });
    }
    Ok(())
}

/// Submits `n` sequences; their events arrive on the returned receivers, in choice order.
pub fn start(state: &AppState, spec: &GenSpec, n: usize) -> Result<Vec<mpsc::UnboundedReceiver<Event>>, ApiError> {
    let n_ctx = state.runtime.n_ctx();
    if spec.prompt.is_empty() {
        return Err(ApiError::InvalidParameter { param: Some("prompt".into()), message: "the prompt is empty".into() });
    }
    if spec.prompt.len() >= n_ctx {
        return Err(ApiError::ContextLengthExceeded { max: n_ctx, prompt: spec.prompt.len() });
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
}

pub async fn collect(mut rx: mpsc::UnboundedReceiver<Event>) -> Result<Choice, ApiError> {
    let mut c = Choice::default();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Started { cached_tokens, .. } => c.cached_tokens = cached_tokens,
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
        Finish::Stop => openapi::FinishReason::Stop,
        Finish::Length => openapi::FinishReason::Length,
    }
}
