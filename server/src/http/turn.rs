//! The assistant's turn as every API sees it: generated text split into thinking, answer
//! and tool calls. Chat completions, Anthropic Messages, Responses and Ollama's chat all
//! answer from this one piece, each in its own shapes, so they agree on what the model said.
//!
//! Streaming holds the answer back while it may still be a tool call (when the request has
//! tools), and decides at the end: tool calls, or the held text as answer.

use super::reasoning::{HarmonyCall, ReasoningFormat, Split, Splitter};
use super::tools::{self, ToolUse};

/// Text of the turn ready to send, in the order it was generated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Reasoning(String),
    Text(String),
}

/// How the model writes its thinking, and whether the prompt left it inside a thinking
/// block.
pub type ReasoningSetup = (ReasoningFormat, bool);

/// One choice's turn as it streams.
pub struct TurnStream {
    splitter: Splitter,
    /// Answer text held back while it may still be a tool call.
    held: String,
    /// Held text turned out to be ordinary answer: it streams from now on.
    plain: bool,
    /// Tool calls the model wrote as harmony messages, given out at the end.
    calls: Vec<HarmonyCall>,
}

impl TurnStream {
    pub fn new((format, opens_thinking): ReasoningSetup) -> TurnStream {
        TurnStream { splitter: Splitter::new(format, opens_thinking), held: String::new(), plain: false, calls: Vec::new() }
    }

    /// The pieces newly generated text makes ready: thinking at once, the answer at once
    /// unless it may still be a tool call.
    pub fn push(&mut self, text: String, tool_use: Option<&ToolUse>) -> Vec<Piece> {
        let split = self.splitter.push(text);
        self.pieces(split, tool_use)
    }

    fn pieces(&mut self, split: Split, tool_use: Option<&ToolUse>) -> Vec<Piece> {
        self.calls.extend(split.calls);
        let mut out = Vec::new();
        if !split.reasoning.is_empty() {
            out.push(Piece::Reasoning(split.reasoning));
        }
        if tool_use.is_some() && !self.plain {
            self.held.push_str(&split.content);
            if !tools::may_be_tool_call(&self.held) {
                self.plain = true;
                out.push(Piece::Text(std::mem::take(&mut self.held)));
            }
        } else if !split.content.is_empty() {
            out.push(Piece::Text(split.content));
        }
        out
    }

    /// The turn ended: the pieces still held back, and the tool calls it made (none when
    /// it answered in text).
    pub fn finish(&mut self, tool_use: Option<&ToolUse>) -> (Vec<Piece>, Vec<HarmonyCall>) {
        let rest = self.splitter.finish();
        let mut pieces = self.pieces(rest, tool_use);
        let mut calls = std::mem::take(&mut self.calls);
        if let (Some(t), false) = (tool_use, self.plain) {
            let held = std::mem::take(&mut self.held);
            if calls.is_empty() {
                calls = found_calls(&held, t);
            }
            if calls.is_empty() && !held.is_empty() {
                pieces.push(Piece::Text(held));
            }
        }
        (pieces, calls)
    }
}

/// A whole turn.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Answer {
    pub reasoning: String,
    /// The answer's text; empty when the turn made tool calls.
    pub text: String,
    pub calls: Vec<HarmonyCall>,
}

impl Answer {
    /// A whole generated text as a turn. Tool calls are looked for in all of the answer,
    /// not only at its start as streaming must.
    pub fn of(text: String, reasoning: ReasoningSetup, tool_use: Option<&ToolUse>) -> Answer {
        let mut splitter = Splitter::new(reasoning.0, reasoning.1);
        let mut split = splitter.push(text);
        let rest = splitter.finish();
        split.reasoning.push_str(&rest.reasoning);
        split.content.push_str(&rest.content);
        split.calls.extend(rest.calls);
        let calls = if split.calls.is_empty() { tool_use.map(|t| found_calls(&split.content, t)).unwrap_or_default() } else { split.calls };
        let text = if calls.is_empty() { split.content } else { String::new() };
        Answer { reasoning: split.reasoning, text, calls }
    }
}

/// The calls to the request's tools written in `text`, at most one when the client asked
/// for one call at a time.
fn found_calls(text: &str, t: &ToolUse) -> Vec<HarmonyCall> {
    let mut calls: Vec<HarmonyCall> = tools::parse_tool_calls(text, &t.tools).into_iter().map(|p| HarmonyCall { name: p.name, arguments: p.arguments }).collect();
    if t.single {
        calls.truncate(1);
    }
    calls
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather() -> ToolUse {
        ToolUse { tools: vec![json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}})], required: false, names: vec![], single: false }
    }

    fn streamed(pieces_of: &[&str], reasoning: ReasoningSetup, tool_use: Option<&ToolUse>) -> Answer {
        let mut turn = TurnStream::new(reasoning);
        let mut answer = Answer::default();
        let mut add = |p: Piece| match p {
            Piece::Reasoning(r) => answer.reasoning.push_str(&r),
            Piece::Text(t) => answer.text.push_str(&t),
        };
        for p in pieces_of {
            turn.push(p.to_string(), tool_use).into_iter().for_each(&mut add);
        }
        let (rest, calls) = turn.finish(tool_use);
        rest.into_iter().for_each(add);
        answer.calls = calls;
        answer
    }

    #[test]
    fn streaming_and_whole_agree_on_thinking_text_and_calls() {
        let think = (ReasoningFormat::ThinkTags, false);
        let cases: [(&[&str], Option<ToolUse>); 5] = [
            (&["<thi", "nk>hm</th", "ink>Hel", "lo"], None),
            // Qwen3.5 / Qwen3-Coder's XML call, cut anywhere.
            (&["<think>a</think>\n\n<tool", "_call>\n<function=get_", "weather>\n<parameter=city>\nOs", "lo\n</parameter>\n</function>\n</tool_call>"], Some(weather())),
            (&["<think>a</think>", "<tool_", "call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}", "</tool_call>"], Some(weather())),
            (&["It is", " sunny"], Some(weather())),
            (&["{\"name\": \"get_weather\", \"arguments\": {}}"], Some(weather())),
        ];
        for (pieces, tools) in cases {
            let s = streamed(pieces, think, tools.as_ref());
            let w = Answer::of(pieces.concat(), think, tools.as_ref());
            assert_eq!(s, w, "{pieces:?}");
        }
        let w = Answer::of("<think>a</think><tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}</tool_call>".into(), think, Some(&weather()));
        assert_eq!((w.reasoning.as_str(), w.text.as_str(), w.calls.len()), ("a", "", 1));
        assert_eq!(w.calls[0].arguments, "{\"city\":\"Oslo\"}");
        let xml = Answer::of("<think>a</think>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>".into(), think, Some(&weather()));
        assert_eq!((xml.text.as_str(), xml.calls.len()), ("", 1));
        assert_eq!(xml.calls[0].arguments, w.calls[0].arguments);
    }

    #[test]
    fn one_call_at_a_time_keeps_the_first() {
        let two = "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"A\"}}</tool_call><tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"B\"}}</tool_call>";
        let none = (ReasoningFormat::None, false);
        assert_eq!(Answer::of(two.into(), none, Some(&weather())).calls.len(), 2);
        let single = ToolUse { single: true, ..weather() };
        let a = Answer::of(two.into(), none, Some(&single));
        assert_eq!(a.calls.len(), 1);
        assert!(a.calls[0].arguments.contains('A'));
        assert_eq!(streamed(&[two], none, Some(&single)).calls, a.calls);
    }
}
