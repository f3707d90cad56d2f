//! Tools and structured output for models whose template may know nothing of tools.
//! Tool definitions go through the chat template when it renders `tools`; otherwise they
//! are described in a system message. Either way the model is asked to answer with
//! `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes/Qwen format most
//! open models are trained on), `tool_choice: required` or a named function enforce that
//! shape by grammar, and the output is parsed back into OpenAI `tool_calls`.

use serde_json::{json, Value};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// Tools the model may call for this request, with how strictly.
pub struct ToolUse {
    pub tools: Vec<Value>,
    /// The model must call a tool (one of `names` when narrowed by `tool_choice`).
    pub required: bool,
    pub names: Vec<String>,
    /// At most one call per turn (OpenAI's `parallel_tool_calls: false`, Anthropic's
    /// `disable_parallel_tool_use`).
    pub single: bool,
}

/// The system text describing the tools, for templates that do not render them.
pub fn tools_system_prompt(tools: &[Value]) -> String {
    let list: Vec<String> = tools.iter().map(|t| t.to_string()).collect();
    format!(
        "You can call functions. To call one, reply with exactly\n{OPEN}{{\"name\": <function name>, \"arguments\": <JSON object of arguments>}}{CLOSE}\nand nothing else. Otherwise answer normally.\nAvailable functions:\n<tools>\n{}\n</tools>",
        list.join("\n")
    )
}

/// How an earlier assistant tool call is written back into the conversation.
pub fn render_tool_call(name: &str, arguments: &str) -> String {
    let args: Value = serde_json::from_str(arguments).unwrap_or_else(|_| Value::String(arguments.to_string()));
    format!("{OPEN}{}{CLOSE}", json!({"name": name, "arguments": args}))
}

/// GBNF that admits exactly one tool call to one of `tools` (restricted to `names` when
/// not empty), with arguments following each function's JSON schema.
pub fn tool_call_grammar(tools: &[Value], names: &[String]) -> Result<String, String> {
    let mut options = Vec::new();
    for t in tools {
        let f = &t["function"];
        let name = f["name"].as_str().unwrap_or_default();
        if !names.is_empty() && !names.iter().any(|n| n == name) {
            continue;
        }
        let params = if f["parameters"].is_object() { f["parameters"].clone() } else { json!({"type": "object"}) };
        options.push(json!({
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": false
        }));
    }
    let schema = if options.len() == 1 { options.remove(0) } else { json!({"anyOf": options}) };
    let inner = engine::sampler::json_schema_grammar(&schema.to_string()).map_err(|e| e.to_string())?;
    Ok(wrap_root(&inner, &format!("{:?} call-json {:?}", OPEN, CLOSE)))
}

/// GBNF for `response_format`: any JSON object, or one following `schema`.
pub fn json_grammar(schema: Option<&Value>) -> Result<String, String> {
    let schema = schema.cloned().unwrap_or_else(|| json!({"type": "object"}));
    engine::sampler::json_schema_grammar(&schema.to_string()).map_err(|e| e.to_string())
}

/// Renames the grammar's `root` rule and makes a new root around it.
fn wrap_root(grammar: &str, new_root: &str) -> String {
    let mut out = format!("root ::= {new_root}\n");
    for line in grammar.lines() {
        match line.strip_prefix("root ::=") {
            Some(rest) => out.push_str(&format!("call-json ::={rest}\n")),
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

/// A tool call found in the model's output.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    pub name: String,
    pub arguments: String,
}

/// Tool calls in `text`, or none if the text is an ordinary answer. A call must name one
/// of the defined tools.
pub fn parse_tool_calls(text: &str, tools: &[Value]) -> Vec<ParsedCall> {
    let known = |n: &str| tools.iter().any(|t| t["function"]["name"].as_str() == Some(n));
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        let after = &rest[start + OPEN.len()..];
        let (body, next) = match after.find(CLOSE) {
            Some(end) => (&after[..end], &after[end + CLOSE.len()..]),
            None => (after, ""),
        };
        if let Some(c) = parse_call(body.trim()).or_else(|| parse_xml_call(body, tools)).or_else(|| parse_glm_call(body, tools)) {
            if known(&c.name) {
                calls.push(c);
            }
        }
        rest = next;
    }
    if calls.is_empty() {
        calls.extend(parse_deepseek_calls(text).into_iter().filter(|c| known(&c.name)));
    }
    if calls.is_empty() {
        calls.extend(parse_gemma4_calls(text).into_iter().filter(|c| known(&c.name)));
    }
    if calls.is_empty() {
        // Models also answer with the bare JSON object.
        if let Some(c) = parse_call(text.trim()) {
            if known(&c.name) {
                calls.push(c);
            }
        }
    }
    calls
}

fn parse_call(s: &str) -> Option<ParsedCall> {
    let v: Value = serde_json::from_str(s).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = v.get("arguments").or_else(|| v.get("parameters")).cloned().unwrap_or(json!({}));
    let arguments = match args {
        Value::String(s) => s,
        other => other.to_string(),
    };
    Some(ParsedCall { name, arguments })
}

/// The XML call Qwen3-Coder, Qwen3.5 and Nemotron Nano 3 write inside `<tool_call>` (their
/// templates ask for it): `<function=NAME>`, then `<parameter=KEY>\nVALUE\n</parameter>`
/// per argument, `</function>`. A value is text where the function's schema says the
/// argument is a string, else JSON when it parses as JSON (numbers, booleans, objects), as
/// llama.cpp reads it.
fn parse_xml_call(body: &str, tools: &[Value]) -> Option<ParsedCall> {
    const PARAM: &str = "<parameter=";
    const PARAM_END: &str = "</parameter>";
    let (name, mut rest) = body.trim_start().strip_prefix("<function=")?.split_once('>')?;
    let name = name.trim();
    let is_text = |key: &str| is_text_argument(tools, name, key);
    let mut args = serde_json::Map::new();
    while let Some(at) = rest.find(PARAM) {
        let (key, after) = rest[at + PARAM.len()..].split_once('>')?;
        // An unclosed last parameter (output cut by max_tokens) ends at the function's end.
        let (raw, next) = match after.find(PARAM_END) {
            Some(end) => (&after[..end], &after[end + PARAM_END.len()..]),
            None => (after.split("</function>").next().unwrap_or(after), ""),
        };
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let key = key.trim();
        let value = if is_text(key) { Value::String(raw.to_string()) } else { serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_string())) };
        args.insert(key.to_string(), value);
        rest = next;
    }
    Some(ParsedCall { name: name.to_string(), arguments: Value::Object(args).to_string() })
}

/// Whether the function `name`'s schema types the argument `key` as a string: models
/// that write bare argument values (the XML and GLM forms) mean text there, JSON elsewhere.
fn is_text_argument(tools: &[Value], name: &str, key: &str) -> bool {
    let properties = tools.iter().find(|t| t["function"]["name"].as_str() == Some(name)).map(|t| &t["function"]["parameters"]["properties"]);
    properties.and_then(|p| p.get(key)).is_some_and(|s| match &s["type"] {
        Value::String(t) => t == "string",
        Value::Array(ts) => ts.iter().any(|t| t == "string"),
        _ => false,
    })
}

/// The call GLM-4.5 to 4.7 (and GLM-4.7-Flash, a `deepseek2` model) write inside
/// `<tool_call>`: the function's name, then `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>`
/// per argument; a value is text where the schema types it a string, else JSON when it
/// parses as JSON.
fn parse_glm_call(body: &str, tools: &[Value]) -> Option<ParsedCall> {
    const KEY: &str = "<arg_key>";
    const KEY_END: &str = "</arg_key>";
    const VALUE: &str = "<arg_value>";
    const VALUE_END: &str = "</arg_value>";
    let (name, mut rest) = match body.find(KEY) {
        Some(at) => (body[..at].trim(), &body[at..]),
        None => (body.trim(), ""),
    };
    if name.is_empty() || name.contains(['<', '>', '{', ' ', '\n']) {
        return None;
    }
    let mut args = serde_json::Map::new();
    while let Some(at) = rest.find(KEY) {
        let (key, after) = rest[at + KEY.len()..].split_once(KEY_END)?;
        let after = after.trim_start().strip_prefix(VALUE)?;
        // An unclosed last value (output cut by max_tokens) keeps what came.
        let (raw, next) = after.split_once(VALUE_END).unwrap_or((after, ""));
        let key = key.trim();
        let value = if is_text_argument(tools, name, key) { Value::String(raw.to_string()) } else { serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_string())) };
        args.insert(key.to_string(), value);
        rest = next;
    }
    Some(ParsedCall { name: name.to_string(), arguments: Value::Object(args).to_string() })
}

/// DeepSeek's call markers (V3, R1 and the R1 distills of Qwen and Llama): tokens of their
/// vocabularies that are read back as this text.
const DS_CALLS: &str = "<｜tool▁calls▁begin｜>";
const DS_CALL: &str = "<｜tool▁call▁begin｜>";
const DS_CALL_END: &str = "<｜tool▁call▁end｜>";
const DS_SEP: &str = "<｜tool▁sep｜>";

/// DeepSeek's calls: after `<｜tool▁calls▁begin｜>`, each `<｜tool▁call▁begin｜>` holds
/// either `function<｜tool▁sep｜>NAME` and the arguments in a ```json fence (V3, R1 and its
/// distills) or `NAME<｜tool▁sep｜>ARGUMENTS` (V3.1 and later), up to `<｜tool▁call▁end｜>`.
fn parse_deepseek_calls(text: &str) -> Vec<ParsedCall> {
    let Some(at) = text.find(DS_CALLS) else { return Vec::new() };
    text[at + DS_CALLS.len()..]
        .split(DS_CALL)
        .skip(1)
        .filter_map(|call| {
            let call = call.split(DS_CALL_END).next().unwrap_or(call);
            let (head, rest) = call.split_once(DS_SEP)?;
            let (name, args) = match head.trim() {
                "function" | "" => {
                    let (name, body) = rest.split_once('\n').unwrap_or((rest, ""));
                    let body = body.trim();
                    let body = body.strip_prefix("```json").or_else(|| body.strip_prefix("```")).unwrap_or(body);
                    (name.trim(), body.trim().strip_suffix("```").unwrap_or(body).trim())
                }
                name => (name, rest.trim()),
            };
            let args: Value = serde_json::from_str(if args.is_empty() { "{}" } else { args }).ok()?;
            Some(ParsedCall { name: name.to_string(), arguments: args.to_string() })
        })
        .collect()
}

/// Gemma 4's call markers (tokens of its vocabulary, rendered as this text) and its string
/// quote.
const GEMMA4_CALL: &str = "<|tool_call>call:";
const GEMMA4_CALL_END: &str = "<tool_call|>";
const GEMMA4_QUOTE: &str = "<|\"|>";
/// Deepest nesting of a Gemma 4 argument value read: a hostile or looping output cannot
/// recurse the parser off the stack.
const GEMMA4_MAX_DEPTH: usize = 64;

/// Gemma 4's calls: `<|tool_call>call:NAME{key:VALUE,…}<tool_call|>`, one after another,
/// where keys are bare, strings are quoted by `<|"|>` and the rest is JSON's numbers,
/// booleans, null, arrays and objects (its template writes them so, and llama.cpp reads
/// them so).
fn parse_gemma4_calls(text: &str) -> Vec<ParsedCall> {
    text.split(GEMMA4_CALL)
        .skip(1)
        .filter_map(|call| {
            let call = call.split(GEMMA4_CALL_END).next().unwrap_or(call);
            let brace = call.find('{')?;
            let name = call[..brace].trim();
            let mut p = Gemma4Value { s: &call[brace..], depth: 0 };
            let args = p.dict()?;
            (!name.is_empty()).then(|| ParsedCall { name: name.to_string(), arguments: args.to_string() })
        })
        .collect()
}

/// A reader of Gemma 4's argument syntax (see [`parse_gemma4_calls`]).
struct Gemma4Value<'a> {
    s: &'a str,
    depth: usize,
}

impl Gemma4Value<'_> {
    fn ws(&mut self) {
        self.s = self.s.trim_start();
    }

    fn eat(&mut self, t: &str) -> bool {
        match self.s.strip_prefix(t) {
            Some(rest) => {
                self.s = rest;
                true
            }
            None => false,
        }
    }

    fn value(&mut self) -> Option<Value> {
        self.ws();
        if self.s.starts_with('{') {
            return self.dict();
        }
        if self.s.starts_with('[') {
            return self.array();
        }
        if self.eat(GEMMA4_QUOTE) {
            let end = self.s.find(GEMMA4_QUOTE)?;
            let v = Value::String(self.s[..end].to_string());
            self.s = &self.s[end + GEMMA4_QUOTE.len()..];
            return Some(v);
        }
        // A JSON scalar (number, true, false, null): up to the next delimiter.
        let end = self.s.find([',', '}', ']']).unwrap_or(self.s.len());
        let v = serde_json::from_str(self.s[..end].trim()).ok()?;
        self.s = &self.s[end..];
        Some(v)
    }

    fn nested<T>(&mut self, f: impl FnOnce(&mut Self) -> Option<T>) -> Option<T> {
        if self.depth >= GEMMA4_MAX_DEPTH {
            return None;
        }
        self.depth += 1;
        let v = f(self);
        self.depth -= 1;
        v
    }

    fn dict(&mut self) -> Option<Value> {
        self.nested(|p| {
            p.ws();
            if !p.eat("{") {
                return None;
            }
            let mut map = serde_json::Map::new();
            p.ws();
            if p.eat("}") {
                return Some(Value::Object(map));
            }
            loop {
                p.ws();
                let colon = p.s.find([':', '}'])?;
                if !p.s[colon..].starts_with(':') {
                    return None;
                }
                let key = p.s[..colon].trim().to_string();
                p.s = &p.s[colon + 1..];
                let v = p.value()?;
                map.insert(key, v);
                p.ws();
                if p.eat("}") {
                    return Some(Value::Object(map));
                }
                if !p.eat(",") {
                    return None;
                }
            }
        })
    }

    fn array(&mut self) -> Option<Value> {
        self.nested(|p| {
            p.ws();
            if !p.eat("[") {
                return None;
            }
            let mut items = Vec::new();
            p.ws();
            if p.eat("]") {
                return Some(Value::Array(items));
            }
            loop {
                items.push(p.value()?);
                p.ws();
                if p.eat("]") {
                    return Some(Value::Array(items));
                }
                if !p.eat(",") {
                    return None;
                }
            }
        })
    }
}

/// Could `text` still turn into a tool call? Streaming holds text back while it might.
pub fn may_be_tool_call(text: &str) -> bool {
    let t = text.trim_start();
    [OPEN, DS_CALLS, GEMMA4_CALL].iter().any(|m| t.starts_with(m) || m.starts_with(t)) || t.starts_with('{')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Vec<Value> {
        vec![json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})]
    }

    #[test]
    fn calls_are_parsed_in_both_shapes_and_unknown_names_ignored() {
        let t = weather();
        let calls = parse_tool_calls("<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}</tool_call>", &t);
        assert_eq!(calls, vec![ParsedCall { name: "get_weather".into(), arguments: "{\"city\":\"Oslo\"}".into() }]);
        assert_eq!(parse_tool_calls(" {\"name\": \"get_weather\", \"arguments\": {}}", &t).len(), 1);
        assert!(parse_tool_calls("<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>", &t).is_empty());
        assert!(parse_tool_calls("It is sunny.", &t).is_empty());
    }

    #[test]
    fn glm_calls_are_parsed_with_typed_arguments() {
        let mut t = weather();
        t.push(json!({"type": "function", "function": {"name": "set_timer", "parameters": {"type": "object", "properties": {"minutes": {"type": "integer"}, "label": {"type": "string"}}}}}));
        // As GLM-4.7-Flash's template writes them, after its reasoning.
        let text = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>San José</arg_value></tool_call><tool_call>set_timer\n<arg_key>minutes</arg_key>\n<arg_value>15</arg_value>\n<arg_key>label</arg_key>\n<arg_value>42</arg_value>\n</tool_call>";
        let calls = parse_tool_calls(text, &t);
        assert_eq!(calls.len(), 2, "{calls:?}");
        assert_eq!(calls[0], ParsedCall { name: "get_weather".into(), arguments: json!({"city": "San José"}).to_string() });
        assert_eq!(serde_json::from_str::<Value>(&calls[1].arguments).unwrap(), json!({"minutes": 15, "label": "42"}));
        // A call without arguments; an unknown function; prose inside the tags.
        assert_eq!(parse_tool_calls("<tool_call>get_weather</tool_call>", &t)[0].arguments, "{}");
        assert!(parse_tool_calls("<tool_call>rm_rf<arg_key>path</arg_key><arg_value>/</arg_value></tool_call>", &t).is_empty());
        assert!(parse_tool_calls("<tool_call>I think I should call get_weather.</tool_call>", &t).is_empty());
    }

    #[test]
    fn gemma4_calls_are_parsed_with_their_own_quotes_and_nesting() {
        let mut t = weather();
        t.push(json!({"type": "function", "function": {"name": "set_timer", "parameters": {"type": "object"}}}));
        let text = "<|tool_call>call:get_weather{city:<|\"|>San José, \"CR\"<|\"|>}<tool_call|><|tool_call>call:set_timer{minutes:15,loud:true,label:null,tags:[<|\"|>tea<|\"|>, <|\"|>a:b}<|\"|>],at:{h:7, m:-2.5}}<tool_call|>";
        let calls = parse_tool_calls(text, &t);
        assert_eq!(calls.len(), 2, "{calls:?}");
        assert_eq!(calls[0], ParsedCall { name: "get_weather".into(), arguments: json!({"city": "San José, \"CR\""}).to_string() });
        let args: Value = serde_json::from_str(&calls[1].arguments).unwrap();
        assert_eq!(args, json!({"minutes": 15, "loud": true, "label": null, "tags": ["tea", "a:b}"], "at": {"h": 7, "m": -2.5}}));
        // No arguments; an unknown tool; broken syntax; nesting past the bound: no call.
        assert_eq!(parse_tool_calls("<|tool_call>call:get_weather{}<tool_call|>", &t)[0].arguments, "{}");
        assert!(parse_tool_calls("<|tool_call>call:rm_rf{}<tool_call|>", &t).is_empty());
        assert!(parse_tool_calls("<|tool_call>call:get_weather{city:<|\"|>Oslo}<tool_call|>", &t).is_empty());
        let deep = format!("<|tool_call>call:set_timer{{a:{}1{}}}<tool_call|>", "[".repeat(10_000), "]".repeat(10_000));
        assert!(parse_tool_calls(&deep, &t).is_empty());
        assert!(may_be_tool_call("<|tool_") && may_be_tool_call("<|tool_call>call:get"));
    }

    #[test]
    fn qwen3_coder_xml_calls_are_parsed_with_typed_arguments() {
        let mut t = weather();
        t.push(json!({"type": "function", "function": {"name": "set_timer", "parameters": {"type": "object", "properties": {
            "minutes": {"type": "integer"}, "label": {"type": ["string", "null"]}, "tags": {"type": "array"}, "loud": {"type": "boolean"}}}}}));
        // As Qwen3.5 writes them: newlines around each value, two calls in a row.
        let text = "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan José\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=set_timer>\n<parameter=minutes>\n15\n</parameter>\n<parameter=label>\n42\n</parameter>\n<parameter=tags>\n[\"tea\", \"kitchen\"]\n</parameter>\n<parameter=loud>\ntrue\n</parameter>\n</function>\n</tool_call>";
        let calls = parse_tool_calls(text, &t);
        assert_eq!(calls.len(), 2, "{calls:?}");
        assert_eq!(calls[0], ParsedCall { name: "get_weather".into(), arguments: json!({"city": "San José"}).to_string() });
        let args: Value = serde_json::from_str(&calls[1].arguments).unwrap();
        // A string-typed argument stays text even when it looks like a number.
        assert_eq!(args, json!({"minutes": 15, "label": "42", "tags": ["tea", "kitchen"], "loud": true}));
        // Multi-line text keeps its inner newlines; a call cut off by max_tokens keeps what came.
        let cut = parse_tool_calls("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork", &t);
        assert_eq!(cut, vec![ParsedCall { name: "get_weather".into(), arguments: json!({"city": "New\nYork"}).to_string() }]);
        // Unknown functions are ignored as in the JSON shape; no parameters is an empty object.
        assert!(parse_tool_calls("<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>", &t).is_empty());
        assert_eq!(parse_tool_calls("<tool_call><function=get_weather></function></tool_call>", &t)[0].arguments, "{}");
    }

    #[test]
    fn deepseek_calls_are_parsed_in_r1_and_v3_1_forms() {
        let t = weather();
        // R1 and its distills: type, separator, name, fenced JSON; two calls.
        let r1 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Oslo\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Bergen\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let calls = parse_tool_calls(r1, &t);
        assert_eq!(calls.iter().map(|c| c.arguments.as_str()).collect::<Vec<_>>(), ["{\"city\":\"Oslo\"}", "{\"city\":\"Bergen\"}"]);
        // V3.1: name, separator, bare JSON.
        let v31 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Oslo\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        assert_eq!(parse_tool_calls(v31, &t), vec![ParsedCall { name: "get_weather".into(), arguments: "{\"city\":\"Oslo\"}".into() }]);
        // Unknown names and broken JSON are no calls; a reply that starts a call is held back.
        assert!(parse_tool_calls(&v31.replace("get_weather", "rm_rf"), &t).is_empty());
        assert!(parse_tool_calls(&v31.replace("}<", "<"), &t).is_empty());
        assert!(may_be_tool_call("<｜tool▁calls"));
    }

    #[test]
    fn the_forced_grammar_wraps_the_schema() {
        let g = tool_call_grammar(&weather(), &[]).unwrap();
        assert!(g.starts_with("root ::= \"<tool_call>\" call-json \"</tool_call>\""), "{g}");
        assert!(g.contains("call-json ::="), "{g}");
        assert!(!g.lines().skip(1).any(|l| l.starts_with("root ::=")), "{g}");
    }

    #[test]
    fn streaming_holds_back_what_may_become_a_call() {
        assert!(may_be_tool_call("  <tool"));
        assert!(may_be_tool_call("<tool_call>{\"na"));
        assert!(!may_be_tool_call("Hello"));
    }
}
