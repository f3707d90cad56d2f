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
        if let Some(c) = parse_call(body.trim()) {
            if known(&c.name) {
                calls.push(c);
            }
        }
        rest = next;
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

/// Could `text` still turn into a tool call? Streaming holds text back while it might.
pub fn may_be_tool_call(text: &str) -> bool {
    let t = text.trim_start();
    t.starts_with(OPEN) || OPEN.starts_with(t) || t.starts_with('{')
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
