//! `POST /v1/completions` (the legacy text API): raw prompts, no chat template.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use engine::sampler::{Sampler, SamplingParams};
use futures::StreamExt;
use openapi::{CompletionChoice, CompletionChunk, CompletionChunkChoice, CompletionLogprobs, CompletionRequest, CompletionResponse, PromptInput, PromptTokensDetails, Usage};

use super::error::ApiError;
use super::generate::{self, finish_reason, sampling_fields, GenSpec};
use crate::process::now_secs;
use super::json::ApiJson;
use super::prepare;
use super::{check_model, AppState};
use crate::runtime::generation::{Event, TokenInfo};

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
        let spec = GenSpec { id: id.clone(), prompt: p.clone(), sampling: sampling.clone(), max_tokens: Some(req.max_new_tokens()), stop: req.stop_sequences(), logprobs, seed: req.seed };
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
                finish_reason: finish_reason(c.finish.unwrap_or(crate::runtime::generation::Finish::Stop)),
            })
            .collect();
        let usage = Usage { prompt_tokens_details: Some(PromptTokensDetails { cached_tokens: cached as u32 }), ..Usage::new(prompt_tokens as u32, completion as u32) };
        return Ok(Json(CompletionResponse { id, object: Default::default(), created, model, choices, usage, system_fingerprint: fingerprint }).into_response());
    }

    let include_usage = req.include_usage();
    let total = receivers.len();
    let chunk = move |choices: Vec<CompletionChunkChoice>, usage: Option<Option<Usage>>| {
        let c = CompletionChunk { id: id.clone(), object: Default::default(), created, model: model.clone(), system_fingerprint: fingerprint.clone(), choices, usage };
        SseEvent::default().data(serde_json::to_string(&c).unwrap_or_default())
    };
    let usage_field = if include_usage { Some(None) } else { None };
    let mut offsets: Vec<usize> = echoes.iter().map(String::len).collect();
    let mut completion = 0;
    let mut cached = 0;
    let mut finished = 0;
    let mut failed = false;
    let head: Vec<SseEvent> = echoes
        .iter()
        .enumerate()
        .filter(|(_, e)| !e.is_empty())
        .map(|(i, e)| chunk(vec![CompletionChunkChoice { text: e.clone(), index: i as u32, logprobs: None, finish_reason: None }], usage_field))
        .collect();
    let body = generate::merged(receivers).flat_map(move |(i, ev)| {
        let mut out = Vec::new();
        if failed {
            return futures::stream::iter(out);
        }
        match ev {
            Event::Started { cached_tokens } => cached = cached.max(cached_tokens),
            Event::Token { text, info } => {
                if !text.is_empty() || info.is_some() {
                    let lp = logprobs.map(|_| legacy_logprobs(info.as_slice(), offsets[i]));
                    offsets[i] += text.len();
                    out.push(chunk(vec![CompletionChunkChoice { text, index: i as u32, logprobs: lp, finish_reason: None }], usage_field));
                }
            }
            Event::Done { finish, completion_tokens } => {
                completion += completion_tokens;
                finished += 1;
                out.push(chunk(vec![CompletionChunkChoice { text: String::new(), index: i as u32, logprobs: None, finish_reason: Some(finish_reason(finish)) }], usage_field));
                if finished == total {
                    if include_usage {
                        out.push(chunk(vec![], Some(Some(Usage { prompt_tokens_details: Some(PromptTokensDetails { cached_tokens: cached as u32 }), ..Usage::new(prompt_tokens as u32, completion as u32) }))));
                    }
                    out.push(SseEvent::default().data("[DONE]"));
                }
            }
            Event::Failed(m) => {
                failed = true;
                out.push(SseEvent::default().data(serde_json::to_string(&ApiError::Internal(m).body()).unwrap_or_default()));
                out.push(SseEvent::default().data("[DONE]"));
            }
            Event::Unavailable(m) => {
                failed = true;
                out.push(SseEvent::default().data(serde_json::to_string(&ApiError::Unavailable(m).body()).unwrap_or_default()));
                out.push(SseEvent::default().data("[DONE]"));
            }
        }
        futures::stream::iter(out)
    });
    let stream = futures::stream::iter(head).chain(body).map(Ok::<_, Infallible>);
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()).into_response())
}

/// Each prompt as tokens and as text (for `echo`).
type Prompts = Vec<(Vec<i32>, String)>;

/// Validation, sampler and tokenization of every prompt: CPU work that may take a while for
/// large prompts, so it runs on a preparation thread (`prepare::run`).
fn prepare(state: &AppState, req: &CompletionRequest) -> Result<(SamplingParams, Prompts), ApiError> {
    req.validate(&state.limits)?;
    check_model(state, &req.model)?;
    let sampling = generate::sampling_params(sampling_fields!(req), None)?;
    Sampler::new(&state.tokenizer, &sampling)?;
    let n_vocab = state.tokenizer.n_vocab();
    let mut prompts = Vec::new();
    for (i, input) in req.prompt.inputs().into_iter().enumerate() {
        match input {
            // The client writes the whole prompt, so its control-token text is meant.
            PromptInput::Text(t) => {
                generate::check_prompt_bytes(state, t.len())?;
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
