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
use crate::sampling::SamplingOptions;

/// The most alternatives per position the legacy completions `logprobs` may ask for.
pub const MAX_COMPLETION_LOGPROBS: u32 = 5;

/// The most messages in one chat request. Rendering and tokenizing are linear in them; the
/// cap is far above any real conversation (the context ends long before) and stops a body of
/// tiny messages from costing a template call per byte.
pub const MAX_MESSAGES: usize = 2048;
/// The most tools in one chat request: OpenAI's own limit.
pub const MAX_TOOLS: usize = 128;
/// The most `logit_bias` entries. Every entry is applied at every sampled token; 1024 is
/// more than OpenAI allows (300) and still costs nothing next to a decode step.
pub const MAX_LOGIT_BIAS: usize = 1024;
/// The longest stop sequence, in bytes. Generated text that may still become a stop
/// sequence is held back from a stream, so this also bounds how far a stream may lag.
pub const MAX_STOP_BYTES: usize = 1024;
/// The most bytes of JSON Schema in one request (`response_format` and every tool's
/// `parameters`, as compact JSON). OpenAI caps the strings of a schema at 120,000
/// characters; this leaves room for descriptions while keeping grammar conversion cheap.
pub const MAX_SCHEMA_BYTES: usize = 128 * 1024;
/// The most properties of one object in a schema. llama.cpp's schema-to-grammar conversion
/// costs the cube of an object's optional properties (and recursed once per property on the
/// stack: 5,000 overflowed it); at this cap one all-optional object converts in well under a
/// second.
pub const MAX_SCHEMA_PROPERTIES: usize = 256;
/// The most `enum` values in all schemas of one request: OpenAI's limit. Grammar sampling
/// checks candidate tokens against every alternative still open, so a huge enum makes every
/// generated token slow.
pub const MAX_SCHEMA_ENUM_VALUES: usize = 1000;
/// The deepest nesting of one schema's JSON (objects and arrays), root = 1. OpenAI allows
/// 10 levels of objects, which take about 2 JSON levels each, plus arrays and `anyOf`.
pub const MAX_SCHEMA_DEPTH: usize = 64;
/// The most conversion work all schemas of a request may take, in schema nodes the
/// converter visits (about 2 µs each), counting each object's optional properties as
/// llama.cpp's cost for them. It follows `$ref`s and `allOf`, which
/// copy properties into every object that uses them, so a small schema cannot expand into a
/// huge one. 50,000 took 0.1–0.2 s here (2 cores, busy); 128 tools of 20 parameters take
/// under 5,000.
/// An object's `n` optional properties count n³/1000: llama.cpp builds the grammar of every
/// suffix of their list by copying the rest of the list at each step (n³/6 string copies of
/// ~10 ns; a visit is 2–4 µs). Measured: 256 → 37 ms, 512 → 0.2 s, 1024 → 1.6–2 s.
pub const MAX_SCHEMA_WORK: u64 = 50_000;

/// Server-chosen bounds on what one request may ask for. Each bound keeps one request's
/// cost (preparation, memory, time per token) small enough that it cannot stall the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The most choices (`n`) per prompt.
    pub max_n: u32,
    /// The most alternatives per position (`top_logprobs`); OpenAI allows 20.
    pub max_top_logprobs: u32,
    /// The most stop sequences; OpenAI allows 4.
    pub max_stop: usize,
    /// The longest stop sequence in bytes ([`MAX_STOP_BYTES`]).
    pub max_stop_bytes: usize,
    /// The most prompts in one `/v1/completions` batch.
    pub max_prompts: usize,
    /// The most chat messages ([`MAX_MESSAGES`]).
    pub max_messages: usize,
    /// The most tools ([`MAX_TOOLS`]).
    pub max_tools: usize,
    /// The most `logit_bias` entries ([`MAX_LOGIT_BIAS`]).
    pub max_logit_bias: usize,
    /// Bounds on the JSON Schemas of one request.
    pub schema: SchemaLimits,
}

/// Bounds on the JSON Schemas of one request (`response_format.json_schema.schema` and
/// the tools' `parameters`), which are turned into sampling grammars.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchemaLimits {
    /// All schemas together, as compact JSON ([`MAX_SCHEMA_BYTES`]).
    pub max_bytes: usize,
    /// Properties of any one object ([`MAX_SCHEMA_PROPERTIES`]).
    pub max_properties: usize,
    /// `enum` values of all schemas together ([`MAX_SCHEMA_ENUM_VALUES`]).
    pub max_enum_values: usize,
    /// JSON nesting of any one schema ([`MAX_SCHEMA_DEPTH`]).
    pub max_depth: usize,
    /// Conversion work of all schemas together ([`MAX_SCHEMA_WORK`]).
    pub max_work: u64,
}

impl Default for SchemaLimits {
    fn default() -> Self {
        SchemaLimits {
            max_bytes: MAX_SCHEMA_BYTES,
            max_properties: MAX_SCHEMA_PROPERTIES,
            max_enum_values: MAX_SCHEMA_ENUM_VALUES,
            max_depth: MAX_SCHEMA_DEPTH,
            max_work: MAX_SCHEMA_WORK,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_n: 8,
            max_top_logprobs: 20,
            max_stop: 4,
            max_stop_bytes: MAX_STOP_BYTES,
            max_prompts: 8,
            max_messages: MAX_MESSAGES,
            max_tools: MAX_TOOLS,
            max_logit_bias: MAX_LOGIT_BIAS,
            schema: SchemaLimits::default(),
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

/// What chat and text completions share, checked by one set of rules: the sampling
/// fields, the number of choices and the stop sequences.
struct Sampling<'a> {
    options: SamplingOptions<'a>,
    n: Option<u32>,
    stop: Option<&'a Stop>,
}

impl Sampling<'_> {
    fn check(&self, limits: &Limits) -> Result<(), WireError> {
        check_range("temperature", self.options.temperature, 0.0, 2.0)?;
        if let Some(top_p) = self.options.top_p {
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
        check_range("presence_penalty", self.options.presence_penalty, -2.0, 2.0)?;
        check_range("frequency_penalty", self.options.frequency_penalty, -2.0, 2.0)?;
        if let Some(bias) = self.options.logit_bias {
            if bias.len() > limits.max_logit_bias {
                return Err(invalid(
                    "logit_bias",
                    format!(
                        "Invalid 'logit_bias': at most {} entries are allowed, got {}.",
                        limits.max_logit_bias,
                        bias.len()
                    ),
                ));
            }
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
            if let Some(long) = stops.iter().find(|s| s.len() > limits.max_stop_bytes) {
                return Err(invalid(
                    "stop",
                    format!(
                        "Invalid 'stop': a stop sequence may be at most {} bytes long, got {}.",
                        limits.max_stop_bytes,
                        long.len()
                    ),
                ));
            }
        }
        if let Some(top_k) = self.options.top_k {
            if top_k < -1 {
                return Err(invalid(
                    "top_k",
                    format!("Invalid 'top_k': expected -1 or 0 (disabled) or a positive count, got {top_k}."),
                ));
            }
        }
        check_range("min_p", self.options.min_p, 0.0, 1.0)?;
        if let Some(penalty) = self.options.repeat_penalty {
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

/// What the schemas of one request have used of [`SchemaLimits`]: bytes and `enum` values
/// add up over all schemas, depth and properties per object hold for each.
struct SchemaBudget<'a> {
    limits: &'a SchemaLimits,
    bytes: usize,
    enum_values: usize,
    work: u64,
}

/// Counts bytes written, so a schema's compact JSON size is known without building it.
struct ByteCount(usize);

impl std::io::Write for ByteCount {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> SchemaBudget<'a> {
    fn new(limits: &'a SchemaLimits) -> Self {
        SchemaBudget {
            limits,
            bytes: 0,
            enum_values: 0,
            work: 0,
        }
    }

    /// Charges `schema` (found at `param`) to the budget; the error names `param`.
    fn spend(&mut self, param: &str, schema: &serde_json::Value) -> Result<(), WireError> {
        let mut size = ByteCount(0);
        // Writing a Value to a counter cannot fail.
        let _ = serde_json::to_writer(&mut size, schema);
        self.bytes += size.0;
        if self.bytes > self.limits.max_bytes {
            return Err(invalid(
                param,
                format!(
                    "Invalid '{param}': the JSON Schemas of a request may take at most {} bytes in all, got {}.",
                    self.limits.max_bytes, self.bytes
                ),
            ));
        }
        self.walk(param, schema, 1)?;
        let work = Expansion::new(schema, self.limits).total().map_err(|why| {
            let message = match why {
                Overrun::Properties(n) => format!(
                    "Invalid '{param}': an object may have at most {} properties, got {n} once 'allOf' merges its parts.",
                    self.limits.max_properties
                ),
                Overrun::Cycle => format!("Invalid '{param}': an 'allOf' includes the object it is part of, which has no finite grammar."),
                Overrun::Deep => format!(
                    "Invalid '{param}': 'allOf' and '$ref' chain deeper than {} levels.",
                    self.limits.max_depth
                ),
            };
            invalid(param, message)
        })?;
        self.work = self.work.saturating_add(work);
        if self.work > self.limits.max_work {
            return Err(invalid(
                param,
                format!(
                    "Invalid '{param}': the JSON Schemas of a request are too complex to turn into a grammar quickly (about {} steps of conversion, at most {}); use fewer optional properties, enum values or 'allOf' merges.",
                    self.work, self.limits.max_work
                ),
            ));
        }
        Ok(())
    }

    fn walk(&mut self, param: &str, value: &serde_json::Value, depth: usize) -> Result<(), WireError> {
        use serde_json::Value;
        if depth > self.limits.max_depth {
            return Err(invalid(
                param,
                format!(
                    "Invalid '{param}': the schema nests deeper than {} levels of objects and arrays.",
                    self.limits.max_depth
                ),
            ));
        }
        match value {
            Value::Object(map) => {
                // Keys are not schema keywords everywhere (a property may be called "enum"),
                // so a count may include a few non-keywords: it errs on the safe side.
                if let Some(Value::Object(properties)) = map.get("properties") {
                    if properties.len() > self.limits.max_properties {
                        return Err(invalid(
                            param,
                            format!(
                                "Invalid '{param}': an object may have at most {} properties, got {}.",
                                self.limits.max_properties,
                                properties.len()
                            ),
                        ));
                    }
                }
                if let Some(Value::Array(values)) = map.get("enum") {
                    self.enum_values += values.len();
                    if self.enum_values > self.limits.max_enum_values {
                        return Err(invalid(
                            param,
                            format!(
                                "Invalid '{param}': the schemas of a request may list at most {} enum values in all, got {}.",
                                self.limits.max_enum_values, self.enum_values
                            ),
                        ));
                    }
                }
                map.values()
                    .try_for_each(|v| self.walk(param, v, depth + 1))
            }
            Value::Array(items) => items
                .iter()
                .try_for_each(|v| self.walk(param, v, depth + 1)),
            _ => Ok(()),
        }
    }
}

/// llama.cpp's cost for an object's `n` optional properties, in node visits (see
/// [`MAX_SCHEMA_WORK`]).
fn optional_work(n: u64) -> u64 {
    n.saturating_mul(n).saturating_mul(n) / 1000
}

/// Why a schema's expansion is refused outright.
enum Overrun {
    /// An object would have this many properties after `allOf` merges.
    Properties(usize),
    /// An `allOf` merges an object into itself (llama.cpp would recurse forever).
    Cycle,
    /// Merges through `$ref`s chain too deep.
    Deep,
}

/// Estimates the work of llama.cpp's schema-to-grammar conversion by following it: every
/// node is visited; a `$ref` is expanded once (it becomes a rule), but `allOf` copies the
/// properties of the objects it names (through `$ref`s) into a new object and visits them
/// again, so the same subtree may be paid for many times.
struct Expansion<'a> {
    root: &'a serde_json::Value,
    limits: &'a SchemaLimits,
    /// The work of each node finished (refs inside counted as one visit).
    done: std::collections::HashMap<*const serde_json::Value, u64>,
    /// Nodes being costed, innermost last.
    open: Vec<*const serde_json::Value>,
    /// `$ref` targets met, each expanded once.
    refs: HashSet<&'a str>,
    pending: Vec<&'a serde_json::Value>,
}

impl<'a> Expansion<'a> {
    fn new(root: &'a serde_json::Value, limits: &'a SchemaLimits) -> Self {
        Expansion {
            root,
            limits,
            done: Default::default(),
            open: Vec::new(),
            refs: HashSet::new(),
            pending: Vec::new(),
        }
    }

    fn total(mut self) -> Result<u64, Overrun> {
        let mut work = self.node(self.root)?;
        while let Some(target) = self.pending.pop() {
            work = work.saturating_add(self.node(target)?);
        }
        Ok(work)
    }

    /// The node a local `$ref` names, if it resolves.
    fn target(&self, reference: &str) -> Option<&'a serde_json::Value> {
        let pointer = reference.strip_prefix('#')?;
        if pointer.is_empty() {
            Some(self.root)
        } else {
            self.root.pointer(pointer)
        }
    }

    /// What `{"$ref": ...}` chains end on, as llama.cpp's `allOf` follows them.
    fn resolve(&self, mut node: &'a serde_json::Value) -> &'a serde_json::Value {
        for _ in 0..self.limits.max_depth {
            match node.get("$ref").and_then(serde_json::Value::as_str).and_then(|r| self.target(r)) {
                Some(next) => node = next,
                None => break,
            }
        }
        node
    }

    fn node(&mut self, node: &'a serde_json::Value) -> Result<u64, Overrun> {
        use serde_json::Value;
        let key = node as *const Value;
        if let Some(&work) = self.done.get(&key) {
            return Ok(work);
        }
        if self.open.contains(&key) {
            return Err(Overrun::Cycle);
        }
        if self.open.len() >= 4 * self.limits.max_depth {
            return Err(Overrun::Deep);
        }
        self.open.push(key);
        let mut work: u64 = 1;
        match node {
            Value::Array(items) => {
                for item in items {
                    work = work.saturating_add(self.node(item)?);
                }
            }
            Value::Object(map) => {
                for (k, v) in map {
                    work = work.saturating_add(match (k.as_str(), v) {
                        ("$ref", Value::String(r)) => {
                            if let Some(target) = self.target(r).filter(|_| self.refs.insert(r)) {
                                self.pending.push(target);
                            }
                            0
                        }
                        ("properties", Value::Object(properties)) => {
                            let required: HashSet<&str> = map.get("required").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_str).collect();
                            let mut optional = properties.keys().filter(|name| !required.contains(name.as_str())).count();
                            if map.get("additionalProperties").is_some_and(|a| *a != Value::Bool(false)) {
                                optional += 1;
                            }
                            let mut w = optional_work(optional as u64);
                            for schema in properties.values() {
                                w = w.saturating_add(self.node(schema)?);
                            }
                            w
                        }
                        ("allOf", Value::Array(parts)) => self.all_of(parts)?,
                        // Reached through `$ref` only; `required` names, `enum` values cost a visit each.
                        ("$defs" | "definitions" | "required", _) => 0,
                        (_, Value::Object(_) | Value::Array(_)) => self.node(v)?,
                        _ => 0,
                    });
                }
            }
            _ => {}
        }
        self.open.pop();
        self.done.insert(key, work);
        Ok(work)
    }

    /// One object made of the properties of every part (required) and of every alternative
    /// of a part's `anyOf`/`oneOf` (optional), each visited again, as llama.cpp builds it.
    fn all_of(&mut self, parts: &'a [serde_json::Value]) -> Result<u64, Overrun> {
        use serde_json::Value;
        let mut work: u64 = 0;
        let (mut entries, mut optional) = (0usize, 0u64);
        for part in parts {
            work = work.saturating_add(self.node(part)?);
            let alternatives = ["anyOf", "oneOf"].iter().find_map(|k| part.get(k).and_then(Value::as_array));
            let (components, is_optional) = match alternatives {
                Some(alts) => (alts.iter().collect::<Vec<_>>(), true),
                None => (vec![part], false),
            };
            for component in components {
                let object = self.resolve(component);
                for schema in object.get("properties").and_then(Value::as_object).into_iter().flat_map(|p| p.values()) {
                    entries += 1;
                    if entries > self.limits.max_properties {
                        return Err(Overrun::Properties(entries));
                    }
                    optional += u64::from(is_optional);
                    work = work.saturating_add(self.node(schema)?);
                }
            }
        }
        Ok(work.saturating_add(optional_work(optional)))
    }
}

impl ChatCompletionRequest {
    /// Checks the request against OpenAI's rules and the server's `limits`.
    pub fn validate(&self, limits: &Limits) -> Result<(), WireError> {
        self.validate_messages(limits)?;
        self.validate_template_kwargs()?;
        Sampling { options: self.sampling(), n: self.n, stop: self.stop.as_ref() }.check(limits)?;
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
        let mut budget = SchemaBudget::new(&limits.schema);
        if let Some(ResponseFormat::JsonSchema { json_schema }) = &self.response_format {
            let param = "response_format.json_schema.schema";
            match &json_schema.schema {
                Some(schema) if schema.is_object() => budget.spend(param, schema)?,
                _ => {
                    return Err(invalid(
                        param,
                        format!("Invalid '{param}': a JSON Schema object is required."),
                    ))
                }
            }
        }
        self.validate_tools(limits, &mut budget)
    }

    /// Template variables are printed by the template outside the marked message text, so
    /// only booleans and numbers are taken (the type does that) under plain names that do
    /// not replace the template's own variables.
    fn validate_template_kwargs(&self) -> Result<(), WireError> {
        /// Far more than any template reads; bounds the work per request.
        const MAX_TEMPLATE_KWARGS: usize = 32;
        const MAX_NAME_LEN: usize = 64;
        let param = "chat_template_kwargs";
        let Some(kwargs) = &self.chat_template_kwargs else { return Ok(()) };
        if kwargs.len() > MAX_TEMPLATE_KWARGS {
            return Err(invalid(param, format!("Invalid '{param}': at most {MAX_TEMPLATE_KWARGS} variables, got {}.", kwargs.len())));
        }
        for name in kwargs.keys() {
            let identifier = name.len() <= MAX_NAME_LEN
                && name.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            if !identifier {
                return Err(invalid(param, format!("Invalid '{param}': {name:?} is not a variable name (letters, digits and _, at most {MAX_NAME_LEN}).")));
            }
            if crate::chat::RESERVED_TEMPLATE_VARIABLES.contains(&name.as_str()) {
                return Err(invalid(param, format!("Invalid '{param}': {name:?} is set by the server{}.", if name == "reasoning_effort" { "; use the 'reasoning_effort' field" } else { "" })));
            }
        }
        Ok(())
    }

    fn validate_messages(&self, limits: &Limits) -> Result<(), WireError> {
        if self.messages.is_empty() {
            return Err(invalid(
                "messages",
                "Invalid 'messages': expected at least one message, got none.",
            ));
        }
        if self.messages.len() > limits.max_messages {
            return Err(invalid(
                "messages",
                format!(
                    "Invalid 'messages': at most {} messages are allowed, got {}.",
                    limits.max_messages,
                    self.messages.len()
                ),
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

    fn validate_tools(&self, limits: &Limits, budget: &mut SchemaBudget) -> Result<(), WireError> {
        // An empty `tools` array is treated as no tools: some clients always send one.
        let tools = self.tools.as_deref().unwrap_or_default();
        if tools.len() > limits.max_tools {
            return Err(invalid(
                "tools",
                format!(
                    "Invalid 'tools': at most {} tools are allowed, got {}.",
                    limits.max_tools,
                    tools.len()
                ),
            ));
        }
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
            if let Some(parameters) = &tool.function.parameters {
                let param = format!("tools[{i}].function.parameters");
                if !parameters.is_object() {
                    return Err(invalid(
                        &param,
                        format!("Invalid '{param}': expected a JSON Schema object."),
                    ));
                }
                budget.spend(&param, parameters)?;
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
        Sampling { options: self.sampling(), n: self.n, stop: self.stop.as_ref() }.check(limits)?;
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
    fn template_variables_are_booleans_and_numbers_under_plain_names() {
        let req = chat(json!({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": false, "budget": 512, "t": 0.5}}));
        req.validate(&Limits::default()).unwrap();
        let vars = req.template_variables();
        assert_eq!(vars["enable_thinking"], json!(false));
        assert_eq!((vars["budget"].clone(), vars["t"].clone(), vars["reasoning_effort"].clone()), (json!(512), json!(0.5), json!("high")));
        // A string could print control tokens outside the marked text: not even parsed.
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"x": "<|im_start|>system"}});
        assert!(serde_json::from_value::<ChatCompletionRequest>(body).is_err());
        let body = json!({"model": "m", "messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "extreme"});
        assert!(serde_json::from_value::<ChatCompletionRequest>(body).is_err());
        for name in ["messages", "add_generation_prompt", "bos_token", "reasoning_effort", "a-b", "1x", "", &"x".repeat(65)] {
            let error = chat_error(json!({"chat_template_kwargs": {name: true}}));
            assert!(matches!(&error, WireError::InvalidParameter { param, .. } if param == "chat_template_kwargs"), "{name}: {error:?}");
        }
        let many: serde_json::Map<String, Value> = (0..33).map(|i| (format!("v{i}"), json!(true))).collect();
        assert!(matches!(chat_error(json!({"chat_template_kwargs": many})), WireError::InvalidParameter { .. }));
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
            ..Limits::default()
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

    /// An object schema with `n` optional string properties.
    fn wide_object(n: usize) -> Value {
        let properties: serde_json::Map<String, Value> = (0..n)
            .map(|i| (format!("p{i}"), json!({"type": "string"})))
            .collect();
        json!({"type": "object", "properties": properties})
    }

    fn nested(levels: usize) -> Value {
        (0..levels).fold(json!({"type": "string"}), |inner, _| {
            json!({"type": "object", "properties": {"x": inner}})
        })
    }

    fn enum_of(n: usize) -> Value {
        json!({"enum": (0..n).map(|i| format!("v{i}")).collect::<Vec<_>>()})
    }

    /// `levels` objects, each with one property that merges the next `fan` times.
    fn merge_chain(levels: usize, fan: usize) -> Value {
        let defs: serde_json::Map<String, Value> = (0..levels)
            .map(|i| {
                let parts: Vec<Value> = (0..fan).map(|_| json!({"$ref": format!("#/$defs/d{}", i + 1)})).collect();
                (format!("d{i}"), json!({"type": "object", "properties": {"p": {"allOf": parts}}}))
            })
            .chain([(format!("d{levels}"), json!({"type": "object", "properties": {"p": {"type": "string"}}}))])
            .collect();
        json!({"$defs": defs, "$ref": "#/$defs/d0"})
    }

    fn with_schema(schema: Value) -> Value {
        json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    }

    fn with_tool_parameters(schemas: Vec<Value>) -> Value {
        let tools: Vec<Value> = schemas
            .into_iter()
            .enumerate()
            .map(|(i, p)| json!({"type": "function", "function": {"name": format!("f{i}"), "parameters": p}}))
            .collect();
        json!({"tools": tools, "tool_choice": "required"})
    }

    #[test]
    fn each_cap_is_a_400_naming_its_param() {
        let schema_param = "response_format.json_schema.schema";
        let long_description = "d".repeat(MAX_SCHEMA_BYTES);
        let deep = nested(MAX_SCHEMA_DEPTH);
        let bias: serde_json::Map<String, Value> = (0..=MAX_LOGIT_BIAS)
            .map(|i| (i.to_string(), json!(1)))
            .collect();
        let messages: Vec<Value> = (0..=MAX_MESSAGES)
            .map(|_| json!({"role": "user", "content": "x"}))
            .collect();
        let cases = [
            (with_schema(wide_object(MAX_SCHEMA_PROPERTIES + 1)), schema_param, "properties"),
            (with_schema(wide_object(5000)), schema_param, "properties"),
            (with_schema(enum_of(MAX_SCHEMA_ENUM_VALUES + 1)), schema_param, "enum"),
            (with_schema(deep), schema_param, "nests"),
            (
                with_schema(json!({"type": "string", "description": long_description})),
                schema_param,
                "bytes",
            ),
            (
                with_tool_parameters(vec![wide_object(1), wide_object(MAX_SCHEMA_PROPERTIES + 1)]),
                "tools[1].function.parameters",
                "properties",
            ),
            // Enum values add up over all the schemas of a request.
            (
                with_tool_parameters(vec![enum_of(600), enum_of(600)]),
                "tools[1].function.parameters",
                "enum",
            ),
            (
                with_tool_parameters((0..=MAX_TOOLS).map(|_| wide_object(1)).collect()),
                "tools",
                "tools",
            ),
            (json!({"logit_bias": bias}), "logit_bias", "entries"),
            (json!({"stop": ["x".repeat(MAX_STOP_BYTES + 1)]}), "stop", "bytes"),
            (json!({"messages": messages}), "messages", "messages"),
            // Many objects each within the caps, too slow to convert together (~1 s).
            (
                with_schema(json!({"type": "object", "properties": (0..20).map(|i| (format!("o{i}"), wide_object(MAX_SCHEMA_PROPERTIES))).collect::<serde_json::Map<_, _>>()})),
                schema_param,
                "too complex",
            ),
            // `allOf` merges the alternatives' properties into one object.
            (
                with_schema(json!({"$defs": {"a": wide_object(100)}, "allOf": [{"anyOf": (0..10).map(|_| json!({"$ref": "#/$defs/a"})).collect::<Vec<_>>()}]})),
                schema_param,
                "allOf",
            ),
            // ... and visits them again in every object: a small schema, an exponential grammar.
            (with_schema(merge_chain(8, 10)), schema_param, "too complex"),
            // An object that merges itself has no finite grammar (llama.cpp recursed forever).
            (
                with_schema(json!({"$defs": {"a": {"type": "object", "properties": {"x": {"allOf": [{"$ref": "#/$defs/a"}]}}}}, "$ref": "#/$defs/a"})),
                schema_param,
                "includes",
            ),
        ];
        for (extra, param, says) in cases {
            let error = chat_error(extra);
            assert_eq!(error.param(), param, "{error}");
            assert!(matches!(error, WireError::InvalidParameter { .. }), "{error:?}");
            assert!(error.message().contains(param) && error.message().contains(says), "{error}");
        }
        let error = completion_error(json!({"stop": "x".repeat(MAX_STOP_BYTES + 1)}));
        assert_eq!(error.param(), "stop");
    }

    #[test]
    fn schemas_at_the_caps_pass() {
        let limits = Limits::default();
        chat(with_schema(wide_object(MAX_SCHEMA_PROPERTIES)))
            .validate(&limits)
            .unwrap();
        chat(with_schema(enum_of(MAX_SCHEMA_ENUM_VALUES)))
            .validate(&limits)
            .unwrap();
        // The root counts as level 1, each wrapping object as 2 more (itself, `properties`).
        chat(with_schema(nested((MAX_SCHEMA_DEPTH - 2) / 2)))
            .validate(&limits)
            .unwrap();
        chat(with_tool_parameters((0..MAX_TOOLS).map(|_| wide_object(8)).collect()))
            .validate(&limits)
            .unwrap();
        chat(json!({"stop": ["x".repeat(MAX_STOP_BYTES)]}))
            .validate(&limits)
            .unwrap();
        chat(with_schema(merge_chain(3, 10))).validate(&limits).unwrap();
        // Refs that cycle through plain references are fine: they become recursive rules.
        chat(with_schema(json!({"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}}, "$ref": "#/$defs/node"})))
            .validate(&limits)
            .unwrap();
        // A property named like a keyword is not mistaken for one.
        chat(with_schema(json!({"type": "object", "properties": {"enum": {"type": "string"}, "properties": {"type": "string"}}})))
            .validate(&limits)
            .unwrap();
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
