//! `POST /v1/completions` (the legacy text API): raw prompts, no chat template.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::State;
use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};
use axum::Json;
use engine::sampler::{Sampler, SamplingParams};
use openapi::{CompletionChoice, CompletionChunk, CompletionChunkChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, PromptInput, Usage};

use super::error::ApiError;
use super::generate::{self, finish_reason, GenSpec};
use super::json::ApiJson;
use super::prepare;
use super::stream;
use super::{check_model, AppState};
use crate::process::now_secs;
use crate::runtime::generation::{Finish, TokenInfo};

pub async fn completions(State(state): State<Arc<AppState>>, ApiJson(req): ApiJson<CompletionRequest>) -> Result<Response, ApiError> {
    generate::check_room(&state)?;
    let (req, (sampling, prompts)) = {
        let state = state.clone();
        prepare::run(move || prepare(&state, &req).map(|p| (req, p))).await?
    };
    let id = format!("cmpl-{}", uuid::Uuid::new_v4().simple());
    let n = req.choices() as usize;
    let logprobs = req.logprobs.map(|k| k as usize);
    let mut receivers = Vec::new();
    let mut prompt_tokens = 0;
    for (p, _) in &prompts {
        prompt_tokens += p.len();
        let spec = GenSpec { id: id.clone(), prompt: p.clone(), sampling: sampling.clone(), max_tokens: Some(req.max_new_tokens()), stop: req.stop_sequences(), logprobs, seed: req.seed, prompt_field: "prompt" };
        receivers.extend(generate::start(&state, &spec, n)?);
    }
    let echoes: Vec<String> = prompts.iter().flat_map(|(_, text)| std::iter::repeat_n(text.clone(), n)).map(|t| if req.echo { t } else { String::new() }).collect();
    let (created, model, fingerprint) = (now_secs(), state.model_id.clone(), state.fingerprint.clone());

    if !req.stream {
        let choices = generate::collect_all(receivers).await?;
        let completion: usize = choices.iter().map(|c| c.completion_tokens).sum();
        let cached = choices.iter().map(|c| c.cached_tokens).max().unwrap_or(0);
        let choices = choices
            .into_iter()
            .zip(echoes)
            .enumerate()
            .map(|(i, (c, echo))| CompletionChoice {
                logprobs: logprobs.map(|_| legacy_logprobs(&c.tokens, echo.len())),
                text: echo + &c.text,
                index: i as u32,
                finish_reason: finish_reason(c.finish.unwrap_or(Finish::Stop)),
            })
            .collect();
        let usage = stream::usage(prompt_tokens, completion, cached);
        return Ok(Json(CompletionResponse { id, object: Default::default(), created, model, choices, usage, system_fingerprint: fingerprint }).into_response());
    }

    let chunks = CompletionChunks { id, created, model, fingerprint, usage_field: req.include_usage().then_some(None), offsets: echoes.iter().map(String::len).collect(), echoes, logprobs };
    Ok(stream::sse(receivers, prompt_tokens, chunks))
}

/// Text completions' chunks: the echoed prompts first (with `echo`), then text as it
/// comes, with legacy log-probabilities whose offsets count from the start of the echo.
struct CompletionChunks {
    id: String,
    created: u64,
    model: String,
    fingerprint: String,
    /// Every chunk carries `usage: null` when usage was asked for.
    usage_field: Option<Option<Usage>>,
    echoes: Vec<String>,
    /// Per choice: bytes of text sent so far.
    offsets: Vec<usize>,
    logprobs: Option<usize>,
}

impl CompletionChunks {
    fn chunk(&self, choices: Vec<CompletionChunkChoice>, usage: Option<Option<Usage>>) -> SseEvent {
        stream::data(&CompletionChunk { id: self.id.clone(), object: Default::default(), created: self.created, model: self.model.clone(), system_fingerprint: self.fingerprint.clone(), choices, usage })
    }
}

impl stream::Chunks for CompletionChunks {
    type Frame = SseEvent;

    fn failure(&mut self, e: &ApiError) -> Vec<SseEvent> {
        stream::openai_failure(e)
    }

    fn opening(&mut self) -> Vec<SseEvent> {
        self.echoes
            .iter()
            .enumerate()
            .filter(|(_, e)| !e.is_empty())
            .map(|(i, e)| self.chunk(vec![CompletionChunkChoice { text: e.clone(), index: i as u32, logprobs: None, finish_reason: None }], self.usage_field))
            .collect()
    }

    fn text(&mut self, i: usize, text: String, info: Option<TokenInfo>) -> Vec<SseEvent> {
        if text.is_empty() && info.is_none() {
            return Vec::new();
        }
        let lp = self.logprobs.map(|_| legacy_logprobs(info.as_slice(), self.offsets[i]));
        self.offsets[i] += text.len();
        vec![self.chunk(vec![CompletionChunkChoice { text, index: i as u32, logprobs: lp, finish_reason: None }], self.usage_field)]
    }

    fn finish(&mut self, i: usize, finish: Finish) -> Vec<SseEvent> {
        vec![self.chunk(vec![CompletionChunkChoice { text: String::new(), index: i as u32, logprobs: None, finish_reason: Some(finish_reason(finish)) }], self.usage_field)]
    }

    fn done(&mut self, usage: Usage) -> Vec<SseEvent> {
        stream::openai_done(self.usage_field.is_some().then(|| self.chunk(vec![], Some(Some(usage)))))
    }
}

/// Each prompt as tokens and as text (for `echo`).
type Prompts = Vec<(Vec<i32>, String)>;

/// Validation, sampler and tokenization of every prompt: CPU work that may take a while for
/// large prompts, so it runs on a preparation thread (`prepare::run`).
fn prepare(state: &AppState, req: &CompletionRequest) -> Result<(SamplingParams, Prompts), ApiError> {
    req.validate(&state.limits)?;
    check_model(state, &req.model)?;
    let sampling = generate::sampling_params(req.sampling(), None)?;
    Sampler::new(&state.tokenizer, &sampling)?;
    let n_vocab = state.tokenizer.n_vocab();
    let mut prompts = Vec::new();
    for (i, input) in req.prompt.inputs().into_iter().enumerate() {
        match input {
            // The client writes the whole prompt, so its control-token text is meant.
            PromptInput::Text(t) => {
                generate::check_prompt_bytes(state, t.len(), "prompt")?;
                prompts.push((state.tokenizer.tokenize(t, true), t.to_string()))
            }
            PromptInput::Tokens(ids) => {
                if let Some(bad) = ids.iter().find(|&&t| t as usize >= n_vocab) {
                    return Err(ApiError::InvalidParameter { param: Some(format!("prompt[{i}]")), message: format!("token id {bad} is outside the vocabulary of {n_vocab}") });
                }
                let ids: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
                let text = state.tokenizer.detokenize(&ids);
                prompts.push((ids, text));
            }
        }
    }
    Ok((sampling, prompts))
}

/// The legacy completions logprobs shape; `offset` is where the generated text starts
/// in the choice's text (after an echoed prompt).
fn legacy_logprobs(tokens: &[TokenInfo], mut offset: usize) -> CompletionLogprobs {
    let mut lp = CompletionLogprobs::default();
    for t in tokens {
        lp.tokens.push(t.logprob.token.clone());
        lp.token_logprobs.push(Some(t.logprob.logprob));
        lp.top_logprobs.push(Some(t.top.iter().map(|a| (a.token.clone(), a.logprob)).collect::<BTreeMap<_, _>>()));
        lp.text_offset.push(offset as u32);
        offset += t.logprob.token.len();
    }
    lp
}
