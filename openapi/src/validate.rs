//! The rules a parsed request must follow before any work is done, each error naming the
//! parameter at fault with OpenAI's path syntax. What needs the model (context length,
//! vocabulary size, the model's name) is checked by the server, which knows it.

use std::collections::{BTreeMap, HashSet};

use crate::chat::{
    ChatCompletionRequest, ContentPart, MessageContent, ResponseFormat, Role, ToolChoice,
    ToolChoiceMode,
};
use crate::completions::{CompletionRequest, PromptInput};
use crate::error::WireError;
use crate::generation::Stop;

/// The most alternatives per position the legacy completions `logprobs` may ask for.
pub const MAX_COMPLETION_LOGPROBS: u32 = 5;

/// Server-chosen bounds on what one request may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The most choices (`n`) per prompt.
    pub max_n: u32,
    /// The most alternatives per position (`top_logprobs`); OpenAI allows 20.
    pub max_top_logprobs: u32,
    /// The most stop sequences; OpenAI allows 4.
    pub max_stop: usize,
    /// The most prompts in one `/v1/completions` batch.
    pub max_prompts: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_n: 8,
            max_top_logprobs: 20,
            max_stop: 4,
            max_prompts: 8,
        }
    }
}

fn invalid(param: impl Into<String>, message: impl Into<String>) -> WireError {
    WireError::InvalidParameter {
        param: param.into(),
        message: message.into(),
    }
}

fn unsupported(param: impl Into<String>, message: impl Into<String>) -> WireError {
    WireError::Unsupported {
        param: param.into(),
        message: message.into(),
    }
}

// `contains` is false for NaN, so NaN is refused too.
fn check_range(param: &str, value: Option<f32>, min: f32, max: f32) -> Result<(), WireError> {
    match value {
        Some(v) if !(min..=max).contains(&v) => Err(invalid(
            param,
            format!("Invalid '{param}': expected a value between {min} and {max}, got {v}."),
        )),
        _ => Ok(()),
    }
}

/// The token ids and biases of a `logit_bias` map, sorted by token id. Checks that every key
/// is a token id and every bias lies in -100..=100; whether the id exists in the vocabulary
/// is for the server, which knows the model.
pub fn parse_logit_bias(bias: &BTreeMap<String, f32>) -> Result<Vec<(u32, f32)>, WireError> {
    let mut parsed = Vec::with_capacity(bias.len());
    for (key, &value) in bias {
        let token = key.trim().parse::<u32>().map_err(|_| {
            invalid(
                "logit_bias",
                format!("Invalid 'logit_bias': key '{key}' is not a token id."),
            )
        })?;
        if !(-100.0..=100.0).contains(&value) {
            return Err(invalid(
                "logit_bias",
                format!("Invalid 'logit_bias': bias of token {key} must be between -100 and 100, got {value}."),
            ));
        }
        parsed.push((token, value));
    }
    parsed.sort_by_key(|&(token, _)| token);
    Ok(parsed)
}

/// The sampling fields chat and text completions share, checked by one set of rules.
struct Sampling<'a> {
    temperature: Option<f32>,
    top_p: Option<f32>,
    n: Option<u32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    logit_bias: Option<&'a BTreeMap<String, f32>>,
    stop: Option<&'a Stop>,
    top_k: Option<i32>,
    min_p: Option<f32>,
    repeat_penalty: Option<f32>,
}

impl Sampling<'_> {
    fn check(&self, limits: &Limits) -> Result<(), WireError> {
        check_range("temperature", self.temperature, 0.0, 2.0)?;
        if let Some(top_p) = self.top_p {
            if !(top_p > 0.0 && top_p <= 1.0) {
                return Err(invalid(
                    "top_p",
                    format!(
                        "Invalid 'top_p': expected a value above 0 and at most 1, got {top_p}."
                    ),
                ));
            }
        }
        if let Some(n) = self.n {
            if n < 1 || n > limits.max_n {
                return Err(invalid(
                    "n",
                    format!(
                        "Invalid 'n': expected a value between 1 and {}, got {n}.",
                        limits.max_n
                    ),
                ));
            }
        }
        check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)?;
        check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?;
        if let Some(bias) = self.logit_bias {
            parse_logit_bias(bias)?;
        }
        if let Some(stop) = self.stop {
            let stops = stop.as_slice();
            if stops.len() > limits.max_stop {
                return Err(invalid(
                    "stop",
                    format!(
                        "Invalid 'stop': at most {} stop sequences are allowed, got {}.",
                        limits.max_stop,
                        stops.len()
                    ),
                ));
            }
            if stops.iter().any(String::is_empty) {
                return Err(invalid(
                    "stop",
                    "Invalid 'stop': stop sequences must not be empty.",
                ));
            }
        }
        if let Some(top_k) = self.top_k {
            if top_k < -1 {
                return Err(invalid(
                    "top_k",
                    format!("Invalid 'top_k': expected -1 or 0 (disabled) or a positive count, got {top_k}."),
                ));
            }
        }
        check_range("min_p", self.min_p, 0.0, 1.0)?;
        if let Some(penalty) = self.repeat_penalty {
            // llama.cpp divides logits by it: 0 would turn them into infinities.
            if !(penalty > 0.0 && penalty.is_finite()) {
                return Err(invalid(
                    "repeat_penalty",
                    format!("Invalid 'repeat_penalty': expected a positive value, got {penalty}."),
                ));
            }
        }
        Ok(())
    }
}

fn check_at_least_one(param: &str, value: Option<u32>) -> Result<(), WireError> {
    match value {
        Some(0) => Err(invalid(
            param,
            format!("Invalid '{param}': expected a value of at least 1, got 0."),
        )),
        _ => Ok(()),
    }
}

/// OpenAI's rule for function names, which chat templates and tool-call parsers rely on.
fn valid_function_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl ChatCompletionRequest {
    /// Checks the request against OpenAI's rules and the server's `limits`.
    pub fn validate(&self, limits: &Limits) -> Result<(), WireError> {
        self.validate_messages()?;
        Sampling {
            temperature: self.temperature,
            top_p: self.top_p,
            n: self.n,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logit_bias: self.logit_bias.as_ref(),
            stop: self.stop.as_ref(),
            top_k: self.top_k,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
        }
        .check(limits)?;
        check_at_least_one("max_tokens", self.max_tokens)?;
        check_at_least_one("max_completion_tokens", self.max_completion_tokens)?;
        if let Some(top) = self.top_logprobs {
            if top > limits.max_top_logprobs {
                return Err(invalid(
                    "top_logprobs",
                    format!(
                        "Invalid 'top_logprobs': expected a value between 0 and {}, got {top}.",
                        limits.max_top_logprobs
                    ),
                ));
            }
            // 0 asks for nothing extra, so it is accepted alone (some clients always send it).
            if top > 0 && self.logprobs != Some(true) {
                return Err(invalid(
                    "top_logprobs",
                    "Invalid 'top_logprobs': 'logprobs' must be true when 'top_logprobs' is used.",
                ));
            }
        }
        if let Some(ResponseFormat::JsonSchema { json_schema }) = &self.response_format {
            if !json_schema
                .schema
                .as_ref()
                .is_some_and(serde_json::Value::is_object)
            {
                return Err(invalid(
                    "response_format.json_schema.schema",
                    "Invalid 'response_format.json_schema.schema': a JSON Schema object is required.",
                ));
            }
        }
        self.validate_tools()
    }

    fn validate_messages(&self) -> Result<(), WireError> {
        if self.messages.is_empty() {
            return Err(invalid(
                "messages",
                "Invalid 'messages': expected at least one message, got none.",
            ));
        }
        for (i, message) in self.messages.iter().enumerate() {
            let at = |field: &str| format!("messages[{i}].{field}");
            if message.role == Role::Function {
                return Err(unsupported(
                    at("role"),
                    format!("Unsupported value: 'messages[{i}].role' is the deprecated 'function'; send tool results with role 'tool'."),
                ));
            }
            if let Some(MessageContent::Parts(parts)) = &message.content {
                if parts.is_empty() && message.role != Role::Assistant {
                    return Err(invalid(
                        at("content"),
                        format!("Invalid 'messages[{i}].content': empty array."),
                    ));
                }
                for (j, part) in parts.iter().enumerate() {
                    if !matches!(part, ContentPart::Text { .. }) {
                        let kind = part.type_name().unwrap_or("this type");
                        return Err(unsupported(
                            format!("messages[{i}].content[{j}].type"),
                            format!("Unsupported value: content part '{kind}' in 'messages[{i}].content[{j}]'; hearth's models read text parts only."),
                        ));
                    }
                }
            }
            let has_tool_calls = message
                .tool_calls
                .as_ref()
                .is_some_and(|calls| !calls.is_empty());
            match message.role {
                Role::Assistant if message.content.is_none() && !has_tool_calls => {
                    return Err(invalid(
                        at("content"),
                        format!("Invalid 'messages[{i}].content': an assistant message needs content or tool_calls."),
                    ));
                }
                Role::Assistant => {}
                _ if message.content.is_none() => {
                    return Err(invalid(
                        at("content"),
                        format!(
                            "Missing required parameter: 'messages[{i}].content' (role '{}').",
                            message.role.as_str()
                        ),
                    ));
                }
                _ if has_tool_calls => {
                    return Err(invalid(
                        at("tool_calls"),
                        format!("Invalid 'messages[{i}].tool_calls': only assistant messages may call tools."),
                    ));
                }
                _ => {}
            }
            if message.role == Role::Tool
                && message.tool_call_id.as_deref().is_none_or(str::is_empty)
            {
                return Err(invalid(
                    at("tool_call_id"),
                    format!("Missing required parameter: 'messages[{i}].tool_call_id' (a tool message answers a tool call)."),
                ));
            }
            for (k, call) in message.tool_calls.iter().flatten().enumerate() {
                if call.function.name.is_empty() {
                    return Err(invalid(
                        format!("messages[{i}].tool_calls[{k}].function.name"),
                        format!(
                            "Invalid 'messages[{i}].tool_calls[{k}].function.name': empty string."
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    fn validate_tools(&self) -> Result<(), WireError> {
        // An empty `tools` array is treated as no tools: some clients always send one.
        let tools = self.tools.as_deref().unwrap_or_default();
        let mut names = HashSet::new();
        for (i, tool) in tools.iter().enumerate() {
            let name = &tool.function.name;
            if !valid_function_name(name) {
                return Err(invalid(
                    format!("tools[{i}].function.name"),
                    format!("Invalid 'tools[{i}].function.name': '{name}' must be 1 to 64 letters, digits, '_' or '-'."),
                ));
            }
            if !names.insert(name.as_str()) {
                return Err(invalid(
                    format!("tools[{i}].function.name"),
                    format!("Invalid 'tools[{i}].function.name': the function '{name}' is defined twice."),
                ));
            }
            if tool
                .function
                .parameters
                .as_ref()
                .is_some_and(|p| !p.is_object())
            {
                return Err(invalid(
                    format!("tools[{i}].function.parameters"),
                    format!(
                        "Invalid 'tools[{i}].function.parameters': expected a JSON Schema object."
                    ),
                ));
            }
        }
        match &self.tool_choice {
            Some(ToolChoice::Mode(ToolChoiceMode::Required)) if tools.is_empty() => Err(invalid(
                "tool_choice",
                "Invalid 'tool_choice': 'required' needs 'tools' to be defined.",
            )),
            Some(ToolChoice::Function(named)) if !names.contains(named.function.name.as_str()) => {
                let name = &named.function.name;
                Err(invalid(
                    "tool_choice",
                    format!(
                        "Invalid 'tool_choice': the function '{name}' is not defined in 'tools'."
                    ),
                ))
            }
            _ => Ok(()),
        }
    }
}

impl CompletionRequest {
    /// Checks the request against OpenAI's rules and the server's `limits`.
    pub fn validate(&self, limits: &Limits) -> Result<(), WireError> {
        let inputs = self.prompt.inputs();
        if inputs.is_empty() {
            return Err(invalid(
                "prompt",
                "Invalid 'prompt': expected at least one prompt, got an empty list.",
            ));
        }
        if inputs.len() > limits.max_prompts {
            return Err(invalid(
                "prompt",
                format!(
                    "Invalid 'prompt': at most {} prompts per request, got {}.",
                    limits.max_prompts,
                    inputs.len()
                ),
            ));
        }
        if inputs
            .iter()
            .any(|input| matches!(input, PromptInput::Tokens(tokens) if tokens.is_empty()))
        {
            return Err(invalid(
                "prompt",
                "Invalid 'prompt': a token list must not be empty.",
            ));
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(unsupported(
                "suffix",
                "Unsupported parameter: 'suffix' (fill-in-the-middle) is not supported.",
            ));
        }
        Sampling {
            temperature: self.temperature,
            top_p: self.top_p,
            n: self.n,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logit_bias: self.logit_bias.as_ref(),
            stop: self.stop.as_ref(),
            top_k: self.top_k,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
        }
        .check(limits)?;
        // With echo, 0 new tokens is how a client scores a prompt.
        if !self.echo {
            check_at_least_one("max_tokens", self.max_tokens)?;
        }
        if let Some(logprobs) = self.logprobs {
            if logprobs > MAX_COMPLETION_LOGPROBS {
                return Err(invalid(
                    "logprobs",
                    format!("Invalid 'logprobs': expected a value between 0 and {MAX_COMPLETION_LOGPROBS}, got {logprobs}."),
                ));
            }
        }
        if let Some(best_of) = self.best_of {
            let n = self.choices();
            if best_of != n {
                return Err(unsupported(
                    "best_of",
                    format!("Unsupported value: 'best_of' ({best_of}) must equal 'n' ({n}); hearth does not rank extra candidates."),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn chat(extra: Value) -> ChatCompletionRequest {
        let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "Hi"}]});
        if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
            body.extend(extra.clone());
        }
        serde_json::from_value(body).expect("request parses")
    }

    fn completion(extra: Value) -> CompletionRequest {
        let mut body = json!({"model": "m", "prompt": "Once"});
        if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
            body.extend(extra.clone());
        }
        serde_json::from_value(body).expect("request parses")
    }

    fn chat_error(extra: Value) -> WireError {
        chat(extra)
            .validate(&Limits::default())
            .expect_err("request is refused")
    }

    fn completion_error(extra: Value) -> WireError {
        completion(extra)
            .validate(&Limits::default())
            .expect_err("request is refused")
    }

    const WEATHER_TOOL: &str = r#"[{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {}}}}]"#;

    fn weather_tools() -> Value {
        serde_json::from_str(WEATHER_TOOL).expect("tool JSON")
    }

    #[test]
    fn good_requests_pass() {
        let limits = Limits::default();
        chat(json!({})).validate(&limits).unwrap();
        chat(json!({
            "temperature": 0, "top_p": 1, "n": 8, "stream": true, "presence_penalty": -2,
            "frequency_penalty": 2, "logit_bias": {"0": -100, "49151": 100}, "logprobs": true,
            "top_logprobs": 20, "stop": ["a", "b", "c", "d"], "max_tokens": 1, "top_k": -1,
            "min_p": 0, "repeat_penalty": 1.1, "tools": weather_tools(), "tool_choice": "required",
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
        }))
        .validate(&limits)
        .unwrap();
        chat(json!({"tool_choice": "auto"}))
            .validate(&limits)
            .unwrap();
        chat(json!({"tools": [], "tool_choice": "none", "top_logprobs": 0}))
            .validate(&limits)
            .unwrap();
        chat(json!({"messages": [
            {"role": "system", "content": ""},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": null,
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}
        ]}))
        .validate(&limits)
        .unwrap();

        completion(json!({})).validate(&limits).unwrap();
        completion(
            json!({"prompt": [[1, 2], [3]], "n": 2, "best_of": 2, "logprobs": 5, "suffix": ""}),
        )
        .validate(&limits)
        .unwrap();
        completion(json!({"echo": true, "max_tokens": 0}))
            .validate(&limits)
            .unwrap();
    }

    #[test]
    fn each_chat_error_names_its_param() {
        let cases = [
            (json!({"messages": []}), "messages"),
            (json!({"temperature": 2.5}), "temperature"),
            (json!({"temperature": -0.1}), "temperature"),
            (json!({"top_p": 0}), "top_p"),
            (json!({"top_p": 1.5}), "top_p"),
            (json!({"n": 0}), "n"),
            (json!({"n": 9}), "n"),
            (json!({"presence_penalty": 2.1}), "presence_penalty"),
            (json!({"frequency_penalty": -3}), "frequency_penalty"),
            (json!({"logit_bias": {"hello": 1}}), "logit_bias"),
            (json!({"logit_bias": {"-1": 1}}), "logit_bias"),
            (json!({"logit_bias": {"5": 101}}), "logit_bias"),
            (json!({"stop": ["a", "b", "c", "d", "e"]}), "stop"),
            (json!({"stop": ""}), "stop"),
            (json!({"max_tokens": 0}), "max_tokens"),
            (json!({"max_completion_tokens": 0}), "max_completion_tokens"),
            (
                json!({"logprobs": true, "top_logprobs": 21}),
                "top_logprobs",
            ),
            (json!({"top_logprobs": 2}), "top_logprobs"),
            (
                json!({"logprobs": false, "top_logprobs": 2}),
                "top_logprobs",
            ),
            (json!({"top_k": -2}), "top_k"),
            (json!({"min_p": 1.5}), "min_p"),
            (json!({"repeat_penalty": 0}), "repeat_penalty"),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}}),
                "response_format.json_schema.schema",
            ),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (
                json!({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
                "tool_choice",
            ),
            (
                json!({"tools": weather_tools(), "tool_choice": {"type": "function", "function": {"name": "other"}}}),
                "tool_choice",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "has space"}}]}),
                "tools[0].function.name",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": ""}}]}),
                "tools[0].function.name",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f"}},
                              {"type": "function", "function": {"name": "f"}}]}),
                "tools[1].function.name",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}),
                "tools[0].function.parameters",
            ),
        ];
        for (extra, param) in cases {
            let error = chat_error(extra.clone());
            assert_eq!(error.param(), param, "for {extra}: {error}");
            assert!(
                matches!(error, WireError::InvalidParameter { .. }),
                "for {extra}: {error:?}"
            );
            assert!(
                error.message().contains(param),
                "message should name '{param}': {error}"
            );
        }
    }

    #[test]
    fn each_message_error_names_its_path() {
        let ok = json!({"role": "user", "content": "Hi"});
        let cases = [
            (json!({"role": "user"}), "messages[1].content", false),
            (
                json!({"role": "system", "content": null}),
                "messages[1].content",
                false,
            ),
            (
                json!({"role": "user", "content": []}),
                "messages[1].content",
                false,
            ),
            (json!({"role": "assistant"}), "messages[1].content", false),
            (
                json!({"role": "tool", "content": "42"}),
                "messages[1].tool_call_id",
                false,
            ),
            (
                json!({"role": "tool", "content": "42", "tool_call_id": ""}),
                "messages[1].tool_call_id",
                false,
            ),
            (
                json!({"role": "user", "content": "x", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}),
                "messages[1].tool_calls",
                false,
            ),
            (
                json!({"role": "assistant", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "", "arguments": "{}"}}]}),
                "messages[1].tool_calls[0].function.name",
                false,
            ),
            (
                json!({"role": "function", "name": "f", "content": "42"}),
                "messages[1].role",
                true,
            ),
            (
                json!({"role": "user", "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}),
                "messages[1].content[1].type",
                true,
            ),
            (
                json!({"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}),
                "messages[1].content[0].type",
                true,
            ),
            (
                json!({"role": "user", "content": [{"type": "hologram"}]}),
                "messages[1].content[0].type",
                true,
            ),
        ];
        for (message, param, is_unsupported) in cases {
            let error = chat_error(json!({"messages": [ok, message]}));
            assert_eq!(error.param(), param, "for {message}: {error}");
            assert_eq!(
                matches!(error, WireError::Unsupported { .. }),
                is_unsupported,
                "for {message}: {error:?}"
            );
        }
        let image = chat_error(
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
        );
        assert!(image.message().contains("image_url"), "{image}");
    }

    #[test]
    fn each_completion_error_names_its_param() {
        let cases = [
            (json!({"prompt": []}), "prompt", false),
            (json!({"prompt": [[1], []]}), "prompt", false),
            (
                json!({"prompt": ["a", "b", "c", "d", "e", "f", "g", "h", "i"]}),
                "prompt",
                false,
            ),
            (json!({"suffix": "end"}), "suffix", true),
            (json!({"max_tokens": 0}), "max_tokens", false),
            (json!({"logprobs": 6}), "logprobs", false),
            (json!({"best_of": 3}), "best_of", true),
            (json!({"n": 2, "best_of": 1}), "best_of", true),
            (json!({"temperature": 3}), "temperature", false),
            (json!({"top_p": -1}), "top_p", false),
            (json!({"n": 100}), "n", false),
            (json!({"stop": ["", "x"]}), "stop", false),
            (json!({"logit_bias": {"1.5": 0}}), "logit_bias", false),
            (json!({"presence_penalty": 9}), "presence_penalty", false),
        ];
        for (extra, param, is_unsupported) in cases {
            let error = completion_error(extra.clone());
            assert_eq!(error.param(), param, "for {extra}: {error}");
            assert_eq!(
                matches!(error, WireError::Unsupported { .. }),
                is_unsupported,
                "for {extra}: {error:?}"
            );
        }
    }

    #[test]
    fn limits_are_the_servers_to_choose() {
        let strict = Limits {
            max_n: 1,
            max_top_logprobs: 2,
            max_stop: 1,
            max_prompts: 1,
        };
        assert_eq!(
            chat(json!({"n": 2})).validate(&strict).unwrap_err().param(),
            "n"
        );
        assert_eq!(
            chat(json!({"logprobs": true, "top_logprobs": 3}))
                .validate(&strict)
                .unwrap_err()
                .param(),
            "top_logprobs"
        );
        assert_eq!(
            chat(json!({"stop": ["a", "b"]}))
                .validate(&strict)
                .unwrap_err()
                .param(),
            "stop"
        );
        assert_eq!(
            completion(json!({"prompt": ["a", "b"]}))
                .validate(&strict)
                .unwrap_err()
                .param(),
            "prompt"
        );
    }

    #[test]
    fn logit_bias_parses_to_sorted_token_ids() {
        let bias = BTreeMap::from([("10".to_string(), 1.0), ("9".to_string(), -100.0)]);
        assert_eq!(
            parse_logit_bias(&bias).unwrap(),
            vec![(9, -100.0), (10, 1.0)]
        );
    }
}
