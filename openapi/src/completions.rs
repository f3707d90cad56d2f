//! `POST /v1/completions`: OpenAI's legacy text completion request, response and stream
//! chunk, which continue a raw prompt without a chat template.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::generation::{constant_tag, present_or_null, FinishReason, Stop, StreamOptions, Usage};

/// OpenAI's `max_tokens` when a completion request leaves it out.
pub const DEFAULT_COMPLETION_MAX_TOKENS: u32 = 16;

constant_tag!(
    /// Always `"text_completion"` (OpenAI uses it for stream chunks too).
    TextCompletionObject::TextCompletion = "text_completion"
);

with_sampling_fields! {
/// A text completion request. Fields hearth does not know are ignored, as OpenAI does.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct CompletionRequest {
    /// The model to use, as listed by `GET /v1/models`.
    #[schema(example = "SmolLM2-135M-Instruct")]
    pub model: String,
    /// The text to continue: a string, a list of strings, token ids, or lists of token ids.
    /// A list is a batch: each prompt gets its own `n` choices.
    pub prompt: Prompt,
    /// Text that should follow the completion (fill-in-the-middle); not supported, refused
    /// unless empty.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suffix: Option<String>,
    /// The most tokens to generate per choice. Default 16, as in OpenAI's API; 0 is allowed
    /// with `echo` to score a prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0, default = 16)]
    pub max_tokens: Option<u32>,
    /// How many choices to generate per prompt. Default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1)]
    pub n: Option<u32>,
    /// Stream the answer as server-sent events (`text_completion` objects, then
    /// `data: [DONE]`).
    #[serde(default)]
    #[schema(default = false)]
    pub stream: bool,
    /// Options for streaming; only read when `stream` is true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    /// Return the log-probabilities of this many most likely tokens at each position
    /// (0..=5), besides the generated token's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0, maximum = 5)]
    pub logprobs: Option<u32>,
    /// Put the prompt in front of the generated text (and in `logprobs`).
    #[serde(default)]
    #[schema(default = false)]
    pub echo: bool,
    /// Up to 4 sequences that end generation; they are not included in the output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Stop>,
    /// Generate this many candidates and return the best `n`; hearth supports only
    /// `best_of` equal to `n`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub best_of: Option<u32>,
    /// Seed of the sampler, for repeatable answers on the same model and settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    /// An id of the end user, recorded in logs only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
}
}

impl CompletionRequest {
    /// The token limit per choice (`max_tokens`, default 16 as in OpenAI's API).
    pub fn max_new_tokens(&self) -> u32 {
        self.max_tokens.unwrap_or(DEFAULT_COMPLETION_MAX_TOKENS)
    }

    /// Choices to generate per prompt (`n`, default 1).
    pub fn choices(&self) -> u32 {
        self.n.unwrap_or(1)
    }

    /// Whether a streamed response must end with a usage chunk.
    pub fn include_usage(&self) -> bool {
        self.stream && self.stream_options.is_some_and(|o| o.include_usage)
    }

    /// The stop sequences, empty when none were given.
    pub fn stop_sequences(&self) -> Vec<String> {
        self.stop.as_ref().map(Stop::to_vec).unwrap_or_default()
    }
}

/// The prompt of a text completion.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Prompt {
    /// One prompt.
    Text(String),
    /// Several prompts.
    Texts(Vec<String>),
    /// One prompt, already tokenized.
    Tokens(Vec<u32>),
    /// Several prompts, already tokenized.
    TokenBatches(Vec<Vec<u32>>),
}

impl Default for Prompt {
    fn default() -> Self {
        Prompt::Text(String::new())
    }
}

/// One prompt out of a [`Prompt`], text or tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptInput<'a> {
    /// Text to tokenize.
    Text(&'a str),
    /// Token ids to use as they are.
    Tokens(&'a [u32]),
}

impl Prompt {
    /// The prompts of the batch, in order; choice indices count through them.
    pub fn inputs(&self) -> Vec<PromptInput<'_>> {
        match self {
            Prompt::Text(text) => vec![PromptInput::Text(text)],
            Prompt::Texts(texts) => texts.iter().map(|t| PromptInput::Text(t)).collect(),
            // An empty token list is one (empty) prompt, not an empty batch, so that
            // validation can refuse it as such.
            Prompt::Tokens(tokens) => vec![PromptInput::Tokens(tokens)],
            Prompt::TokenBatches(batches) => {
                batches.iter().map(|t| PromptInput::Tokens(t)).collect()
            }
        }
    }
}

/// A text completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CompletionResponse {
    /// A unique id of the completion (`cmpl-...`).
    pub id: String,
    /// Always `text_completion`.
    pub object: TextCompletionObject,
    /// When the completion was created, in Unix seconds.
    pub created: u64,
    /// The model that generated it.
    pub model: String,
    /// The generated choices: `n` per prompt, prompt by prompt.
    pub choices: Vec<CompletionChoice>,
    /// Token counts of the request.
    pub usage: Usage,
    /// Identifies the model file and server build that generated it, for reproducibility
    /// with `seed`.
    pub system_fingerprint: String,
}

/// One generated continuation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CompletionChoice {
    /// The generated text (after the prompt, when `echo` is set).
    pub text: String,
    /// The choice's position: prompt index × `n` + choice number.
    pub index: u32,
    /// Log-probabilities of the tokens; null unless `logprobs` was set.
    #[schema(required = true)]
    pub logprobs: Option<CompletionLogprobs>,
    /// Why generation stopped.
    pub finish_reason: FinishReason,
}

/// Log-probabilities in the legacy completions shape: parallel lists, one entry per token.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct CompletionLogprobs {
    /// The tokens' text.
    pub tokens: Vec<String>,
    /// Each token's log-probability; null for the first echoed prompt token, which has no
    /// context to be predicted from.
    pub token_logprobs: Vec<Option<f32>>,
    /// The `logprobs` most likely tokens at each position with their log-probabilities;
    /// null where `token_logprobs` is.
    pub top_logprobs: Vec<Option<BTreeMap<String, f32>>>,
    /// Each token's character offset in the choice's `text`.
    pub text_offset: Vec<u32>,
}

/// One server-sent event of a streamed text completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CompletionChunk {
    /// The completion's id, the same in every chunk.
    pub id: String,
    /// Always `text_completion`.
    pub object: TextCompletionObject,
    /// When the completion was created, in Unix seconds, the same in every chunk.
    pub created: u64,
    /// The model that generates it.
    pub model: String,
    /// Identifies the model file and server build.
    pub system_fingerprint: String,
    /// What this chunk adds to each choice; empty in the final usage chunk.
    pub choices: Vec<CompletionChunkChoice>,
    /// Absent unless `stream_options.include_usage`; then null in every chunk except the
    /// last, which carries the request's usage. (Rust: `None` omits the field, `Some(None)`
    /// writes `null`.)
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "present_or_null"
    )]
    #[schema(value_type = Option<Usage>)]
    pub usage: Option<Option<Usage>>,
}

/// What one chunk adds to one choice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CompletionChunkChoice {
    /// New text, cut on UTF-8 character boundaries.
    pub text: String,
    /// The choice's position: prompt index × `n` + choice number.
    pub index: u32,
    /// Log-probabilities of the tokens in `text`; null unless `logprobs` was set.
    #[schema(required = true)]
    pub logprobs: Option<CompletionLogprobs>,
    /// Null until the choice's last chunk, which says why it stopped.
    #[schema(required = true)]
    pub finish_reason: Option<FinishReason>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(value: serde_json::Value) -> CompletionRequest {
        serde_json::from_value(value).expect("request parses")
    }

    #[test]
    fn every_prompt_form_parses() {
        let cases = [
            (json!("Once upon"), vec![PromptInput::Text("Once upon")]),
            (
                json!(["a", "b"]),
                vec![PromptInput::Text("a"), PromptInput::Text("b")],
            ),
            (json!([1, 2, 3]), vec![PromptInput::Tokens(&[1, 2, 3])]),
            (
                json!([[1], [2, 3]]),
                vec![PromptInput::Tokens(&[1]), PromptInput::Tokens(&[2, 3])],
            ),
        ];
        for (prompt, expected) in cases {
            let req = parse(json!({"model": "m", "prompt": prompt}));
            assert_eq!(req.prompt.inputs(), expected);
        }
    }

    #[test]
    fn defaults_follow_openai() {
        let req = parse(json!({"model": "m", "prompt": "x", "future_field": 1}));
        assert_eq!(req.max_new_tokens(), 16);
        assert_eq!(req.choices(), 1);
        assert!(!req.echo && !req.stream && !req.include_usage());

        let req = parse(json!({
            "model": "m", "prompt": "x", "max_tokens": 5, "n": 2, "best_of": 2, "echo": true,
            "logprobs": 2, "stop": "\n", "suffix": "", "stream": true,
            "stream_options": {"include_usage": true}, "logit_bias": {"1": 5}, "seed": -1,
            "top_k": 0, "min_p": 0.1, "repeat_penalty": 1.0
        }));
        assert_eq!((req.max_new_tokens(), req.choices()), (5, 2));
        assert!(req.include_usage());
        assert_eq!(req.stop_sequences(), vec!["\n"]);
    }

    #[test]
    fn response_and_chunks_have_openai_shape() {
        let response = CompletionResponse {
            id: "cmpl-1".into(),
            object: TextCompletionObject::TextCompletion,
            created: 7,
            model: "m".into(),
            choices: vec![CompletionChoice {
                text: " there".into(),
                index: 0,
                logprobs: Some(CompletionLogprobs {
                    tokens: vec!["Hi".into(), " there".into()],
                    token_logprobs: vec![None, Some(-1.25)],
                    top_logprobs: vec![None, Some(BTreeMap::from([(" there".to_string(), -1.25)]))],
                    text_offset: vec![0, 2],
                }),
                finish_reason: FinishReason::Length,
            }],
            usage: Usage::new(1, 1),
            system_fingerprint: "fp".into(),
        };
        assert_eq!(
            json!(response),
            json!({
                "id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
                "choices": [{
                    "text": " there", "index": 0, "finish_reason": "length",
                    "logprobs": {
                        "tokens": ["Hi", " there"],
                        "token_logprobs": [null, -1.25],
                        "top_logprobs": [null, {" there": -1.25}],
                        "text_offset": [0, 2]
                    }
                }],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                "system_fingerprint": "fp"
            })
        );

        let chunk = CompletionChunk {
            id: "cmpl-1".into(),
            object: TextCompletionObject::TextCompletion,
            created: 7,
            model: "m".into(),
            system_fingerprint: "fp".into(),
            choices: vec![CompletionChunkChoice {
                text: "Hi".into(),
                index: 1,
                logprobs: None,
                finish_reason: None,
            }],
            usage: None,
        };
        assert_eq!(
            json!(chunk),
            json!({"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
                   "system_fingerprint": "fp",
                   "choices": [{"text": "Hi", "index": 1, "logprobs": null, "finish_reason": null}]})
        );
        let usage_chunk = CompletionChunk {
            choices: vec![],
            usage: Some(Some(Usage::new(2, 3))),
            ..chunk
        };
        assert_eq!(json!(usage_chunk)["usage"]["total_tokens"], json!(5));
        assert_eq!(json!(usage_chunk)["choices"], json!([]));
    }
}
