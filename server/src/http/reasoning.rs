//! Reasoning models' thinking, kept apart from their answer (`reasoning_content`, as
//! llama-server, vLLM and exo return it).
//!
//! Two ways models write it, told apart by their chat template:
//! - **think tags** (Qwen3, QwQ, DeepSeek-R1, GLM-4.5): `<think>…</think>` then the answer.
//! - **thought channel** (Gemma 4): `<|channel>thought…<channel|>` then the answer; a
//!   stray `<channel|>` the model sometimes adds after its answer is dropped, as
//!   llama.cpp's parser drops it.
//! - **harmony** (gpt-oss): messages on channels — `<|channel|>analysis<|message|>…` is the
//!   thinking, `…<|channel|>final<|message|>…` the answer, and
//!   `<|channel|>commentary to=functions.NAME …<|message|>{…}` a tool call. A message ends
//!   where the next `<|start|>` begins (`<|end|>` is a control token and renders as
//!   nothing; llama.cpp renders `<|channel|>`, `<|message|>`, `<|start|>` and
//!   `<|constrain|>` as text). Without this the answer would read
//!   `<|channel|>analysis<|message|>…<|start|>assistant<|channel|>final<|message|>Hello`.
//!
//! The splitter takes the generated text as it streams and holds back only what may be
//! the start of a marker. It must not depend on the runtime: it sees text only.

/// How the model in use writes its reasoning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReasoningFormat {
    /// No reasoning markup: all text is the answer.
    #[default]
    None,
    ThinkTags,
    /// Gemma 4's `<|channel>thought` … `<channel|>`.
    ThoughtChannel,
    Harmony,
}

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const THOUGHT_OPEN: &str = "<|channel>thought";
const THOUGHT_CLOSE: &str = "<channel|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
/// What ends a harmony message in rendered text (the next message's start, or the end
/// tokens when a vocabulary renders them).
const MESSAGE_ENDS: [&str; 4] = ["<|start|>", "<|end|>", "<|call|>", "<|return|>"];
/// The longest of them.
const MAX_MARKER_BYTES: usize = 10;
/// A harmony header longer than this without `<|message|>` is not a header: the model
/// wrote plain text, which is the answer.
const MAX_HEADER_BYTES: usize = 256;

impl ReasoningFormat {
    /// The format a chat template's model writes, from the template's source.
    pub fn detect(template_source: &str) -> ReasoningFormat {
        if template_source.contains(CHANNEL) && template_source.contains(MESSAGE) {
            ReasoningFormat::Harmony
        } else if template_source.contains("<|channel>") && template_source.contains(THOUGHT_CLOSE) {
            ReasoningFormat::ThoughtChannel
        } else if template_source.contains(THINK_OPEN) {
            ReasoningFormat::ThinkTags
        } else {
            ReasoningFormat::None
        }
    }

    /// The markers around a reasoning block, for the formats that write one.
    fn tags(self) -> Option<(&'static str, &'static str)> {
        match self {
            ReasoningFormat::ThinkTags => Some((THINK_OPEN, THINK_CLOSE)),
            ReasoningFormat::ThoughtChannel => Some((THOUGHT_OPEN, THOUGHT_CLOSE)),
            _ => None,
        }
    }
}

/// A tool call written as a harmony message to `functions.NAME`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HarmonyCall {
    pub name: String,
    pub arguments: String,
}

/// What a piece of generated text holds: thinking, answer, and finished tool calls.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
    pub calls: Vec<HarmonyCall>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Plain answer text (think tags: outside `<think>`; harmony: a model that wrote no header).
    Content,
    /// Inside `<think>`.
    Thinking,
    /// Harmony: reading a message header, up to `<|message|>`.
    Header,
    /// Harmony: a message's body, on the channel the header named.
    Body(Channel),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Channel {
    Reasoning,
    Content,
    /// A tool call to this function; its body is the arguments.
    Call(String),
}

/// Splits one choice's text as it streams.
#[derive(Debug)]
pub struct Splitter {
    format: ReasoningFormat,
    state: State,
    /// Text not yet decided (a possible marker prefix, a header, a call's arguments).
    held: String,
    /// Drop whitespace before the answer's first character (after `</think>`).
    trim_content_start: bool,
    /// Harmony call arguments: bytes of `held` already searched for the message's end, so
    /// long arguments are scanned once, not again with every token.
    scanned: usize,
}

impl Splitter {
    /// `prompt_opens_thinking`: the rendered prompt ends inside `<think>` (templates that
    /// open it for the model), so the text starts as reasoning.
    pub fn new(format: ReasoningFormat, prompt_opens_thinking: bool) -> Splitter {
        let state = match format {
            ReasoningFormat::Harmony => State::Header,
            ReasoningFormat::ThinkTags | ReasoningFormat::ThoughtChannel if prompt_opens_thinking => State::Thinking,
            _ => State::Content,
        };
        Splitter { format, state, held: String::new(), trim_content_start: false, scanned: 0 }
    }

    /// Whether the rendered prompt leaves the model inside a reasoning block (`<think>`,
    /// Gemma 4's `<|channel>thought`).
    pub fn prompt_opens_thinking(prompt_text: &str) -> bool {
        let tail = prompt_text.trim_end();
        [(THINK_OPEN, THINK_CLOSE), (THOUGHT_OPEN, THOUGHT_CLOSE)].iter().any(|(o, c)| tail.rfind(o).is_some_and(|open| !tail[open..].contains(c)))
    }

    /// The next piece of generated text: what can be told apart now. A model without
    /// reasoning markup gets its text back as the answer, uncopied.
    pub fn push(&mut self, text: String) -> Split {
        if self.format == ReasoningFormat::None {
            return Split { content: text, ..Split::default() };
        }
        let mut out = Split::default();
        self.held.push_str(&text);
        self.drain(&mut out, false);
        out
    }

    /// The text is complete: everything held is decided.
    pub fn finish(&mut self) -> Split {
        let mut out = Split::default();
        self.drain(&mut out, true);
        out
    }

    fn drain(&mut self, out: &mut Split, end: bool) {
        loop {
            match self.state.clone() {
                State::Content if self.format.tags().is_some() => {
                    let (open, close) = self.format.tags().expect("checked");
                    // Gemma 4 may close a block it never opened after its answer.
                    let stray = self.format == ReasoningFormat::ThoughtChannel;
                    let markers: &[&str] = if stray { &[open, close] } else { &[open] };
                    // Which marker comes first, decided before `take_until` drops it (no copy
                    // of the held text per token).
                    let closes = stray && first_marker(&self.held, markers).is_some_and(|(at, len)| self.held[at..at + len] == *close);
                    if !self.take_until(markers, end, |s, t| s.answer(out, t)) {
                        return;
                    }
                    if closes {
                        continue;
                    }
                    self.state = State::Thinking;
                }
                State::Content => {
                    let text = std::mem::take(&mut self.held);
                    self.answer(out, &text);
                    return;
                }
                State::Thinking => {
                    let close = self.format.tags().map_or(THINK_CLOSE, |(_, c)| c);
                    if !self.take_until(&[close], end, |_, t| out.reasoning.push_str(t)) {
                        return;
                    }
                    self.state = State::Content;
                    self.trim_content_start = true;
                }
                State::Header => {
                    let Some(at) = self.held.find(MESSAGE) else {
                        let plain = self.held.len() > MAX_HEADER_BYTES || (!self.held.is_empty() && !could_be_header(&self.held));
                        if plain || end {
                            self.state = State::Content;
                            continue;
                        }
                        return;
                    };
                    let header: String = self.held.drain(..at + MESSAGE.len()).collect();
                    self.state = State::Body(channel_of(&header[..at]));
                }
                State::Body(channel) => {
                    let done = if let Channel::Call(name) = &channel {
                        // A call's arguments are decided when its message ends. A marker
                        // may straddle the last search's end: look again from before it.
                        let from = self.scanned.saturating_sub(MAX_MARKER_BYTES);
                        let from = (0..=from).rev().find(|&i| self.held.is_char_boundary(i)).unwrap_or(0);
                        let found = first_marker(&self.held[from..], &MESSAGE_ENDS).map(|(at, len)| (from + at, len));
                        let args = match found {
                            Some((at, len)) => {
                                let args: String = self.held.drain(..at).collect();
                                self.held.drain(..len);
                                args
                            }
                            None if end => std::mem::take(&mut self.held),
                            None => {
                                self.scanned = self.held.len();
                                return;
                            }
                        };
                        self.scanned = 0;
                        out.calls.push(HarmonyCall { name: name.clone(), arguments: args.trim().to_string() });
                        if found.is_none() {
                            return;
                        }
                        true
                    } else {
                        self.take_until(&MESSAGE_ENDS, end, |s, t| match channel {
                            Channel::Reasoning => out.reasoning.push_str(t),
                            _ => s.answer(out, t),
                        })
                    };
                    if !done {
                        return;
                    }
                    self.state = State::Header;
                }
            }
        }
    }

    /// Answer text, without the whitespace that follows a closed think block.
    fn answer(&mut self, out: &mut Split, text: &str) {
        let text = if self.trim_content_start { text.trim_start() } else { text };
        if !text.is_empty() {
            self.trim_content_start = false;
        }
        out.content.push_str(text);
    }

    /// Emits held text up to the first of `markers` through `emit` and drops the marker
    /// (true), or, with no marker yet, emits all but a possible marker's start (false; at
    /// the end, everything).
    fn take_until(&mut self, markers: &[&str], end: bool, mut emit: impl FnMut(&mut Self, &str)) -> bool {
        if let Some((at, len)) = first_marker(&self.held, markers) {
            let before: String = self.held.drain(..at).collect();
            self.held.drain(..len);
            emit(self, &before);
            return true;
        }
        let keep = if end { 0 } else { markers.iter().map(|m| partial_suffix(&self.held, m)).max().unwrap_or(0) };
        let cut = self.held.len() - keep;
        let now: String = self.held.drain(..cut).collect();
        emit(self, &now);
        false
    }
}

/// The earliest of `markers` in `text`: (byte offset, marker length).
fn first_marker(text: &str, markers: &[&str]) -> Option<(usize, usize)> {
    markers.iter().filter_map(|m| text.find(m).map(|at| (at, m.len()))).min()
}

/// Length of the longest suffix of `text` that is a proper prefix of `marker`.
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1)).rev().find(|&n| text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..])).unwrap_or(0)
}

/// Whether `text` may still become a harmony header: `<|channel|>…`, `<|start|>assistant…`,
/// the role name the prompt's `<|start|>` left open, or a recipient right after it
/// (` to=functions.NAME<|channel|>commentary json`, as gpt-oss's template writes calls).
fn could_be_header(text: &str) -> bool {
    let t = text.trim_start();
    ["<|channel|>", "<|start|>", "assistant", "to="].iter().any(|h| t.starts_with(h) || h.starts_with(t))
}

/// The channel a harmony header names: `analysis` is reasoning, a message to
/// `functions.NAME` is a call, anything else (final, commentary preambles) the answer.
fn channel_of(header: &str) -> Channel {
    let recipient = header.split_whitespace().chain(header.split(CHANNEL)).find_map(|w| w.trim().strip_prefix("to=")).map(|r| r.split(['<', ' ']).next().unwrap_or(r).to_string());
    if let Some(name) = recipient.as_deref().and_then(|r| r.strip_prefix("functions.")) {
        return Channel::Call(name.to_string());
    }
    let channel = header.rsplit(CHANNEL).next().unwrap_or("").split([' ', '<']).next().unwrap_or("");
    if header.contains(CHANNEL) && channel == "analysis" {
        Channel::Reasoning
    } else {
        Channel::Content
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `pieces` one by one and then finishes, gathering everything.
    fn run(format: ReasoningFormat, opens: bool, pieces: &[&str]) -> Split {
        let mut s = Splitter::new(format, opens);
        let mut all = Split::default();
        let mut add = |p: Split| {
            all.reasoning.push_str(&p.reasoning);
            all.content.push_str(&p.content);
            all.calls.extend(p.calls);
        };
        for p in pieces {
            add(s.push(p.to_string()));
        }
        add(s.finish());
        all
    }

    /// `text` split as `want`, fed whole and one character at a time.
    fn assert_splits_in_any_pieces(format: ReasoningFormat, text: &str, want: &Split) {
        assert_eq!(&run(format, false, &[text]), want);
        let chars: Vec<String> = text.chars().map(String::from).collect();
        assert_eq!(&run(format, false, &chars.iter().map(String::as_str).collect::<Vec<_>>()), want);
    }

    #[test]
    fn formats_come_from_the_template() {
        assert_eq!(ReasoningFormat::detect("{{ '<|start|>assistant<|channel|>final<|message|>' }}"), ReasoningFormat::Harmony);
        assert_eq!(ReasoningFormat::detect("{%- if enable_thinking %}<think>{% endif %}"), ReasoningFormat::ThinkTags);
        assert_eq!(ReasoningFormat::detect("{{ '<|im_start|>assistant\\n' }}"), ReasoningFormat::None);
    }

    #[test]
    fn think_tags_split_whole_and_in_any_pieces() {
        let text = "<think>\nThe user greets me.\n</think>\n\nHello there!";
        let want = Split { reasoning: "\nThe user greets me.\n".into(), content: "Hello there!".into(), calls: vec![] };
        assert_splits_in_any_pieces(ReasoningFormat::ThinkTags, text, &want);
        // A template that opens the block itself: the text starts as reasoning.
        assert_eq!(run(ReasoningFormat::ThinkTags, true, &["Hmm.", "</think>", "Hi"]), Split { reasoning: "Hmm.".into(), content: "Hi".into(), calls: vec![] });
        // No tags at all: all answer; an unclosed block: all reasoning.
        assert_eq!(run(ReasoningFormat::ThinkTags, false, &["Just ", "an answer <b>"]).content, "Just an answer <b>");
        assert_eq!(run(ReasoningFormat::ThinkTags, false, &["<think>still thin", "king"]).reasoning, "still thinking");
        assert!(Splitter::prompt_opens_thinking("<|im_start|>assistant\n<think>\n"));
        assert!(!Splitter::prompt_opens_thinking("<think>a</think>\n<|im_start|>assistant\n"));
    }

    #[test]
    fn gemma4_thought_channel_splits_whole_and_in_any_pieces() {
        assert_eq!(ReasoningFormat::detect("{{- '<|channel>thought\n' -}}{{ reasoning }}{{- '<channel|>' -}}"), ReasoningFormat::ThoughtChannel);
        assert_eq!(ReasoningFormat::detect(include_str!("../../../testdata/gemma4-chat-template.jinja")), ReasoningFormat::ThoughtChannel);
        let text = "<|channel>thought\nThe user wants a haiku.<channel|>Autumn moon rises";
        let want = Split { reasoning: "\nThe user wants a haiku.".into(), content: "Autumn moon rises".into(), calls: vec![] };
        assert_splits_in_any_pieces(ReasoningFormat::ThoughtChannel, text, &want);
        // A stray close after the answer, and an empty second block, are not answer text.
        let text = "<|channel>thought\nHm.<channel|>Done.<|channel>thought\n<channel|><channel|>";
        let want = Split { reasoning: "\nHm.\n".into(), content: "Done.".into(), calls: vec![] };
        assert_splits_in_any_pieces(ReasoningFormat::ThoughtChannel, text, &want);
        assert!(Splitter::prompt_opens_thinking("<|turn>model\n<|channel>thought\n"));
    }

    #[test]
    fn a_partial_marker_is_held_back_until_it_is_decided() {
        let mut s = Splitter::new(ReasoningFormat::ThinkTags, false);
        assert_eq!(s.push("Hi <th".into()).content, "Hi ");
        assert_eq!(s.push("ere".into()).content, "<there");
        let mut s = Splitter::new(ReasoningFormat::ThinkTags, false);
        assert_eq!(s.push("<thi".into()).content, "");
        let p = s.push("nk>Let me see".into());
        assert_eq!((p.reasoning.as_str(), p.content.as_str()), ("Let me see", ""));
    }

    #[test]
    fn harmony_channels_become_reasoning_and_answer() {
        let text = "<|channel|>analysis<|message|>User says hi. Respond.<|start|>assistant<|channel|>final<|message|>Hello! How can I help?";
        let want = Split { reasoning: "User says hi. Respond.".into(), content: "Hello! How can I help?".into(), calls: vec![] };
        assert_splits_in_any_pieces(ReasoningFormat::Harmony, text, &want);
        // Token by token, as the model writes it (markers are whole tokens).
        let tokens = ["<|channel|>", "analysis", "<|message|>", "User", " says hi.", "<|end|>", "<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "Hello", "!"];
        assert_eq!(run(ReasoningFormat::Harmony, false, &tokens), Split { reasoning: "User says hi.".into(), content: "Hello!".into(), calls: vec![] });
    }

    #[test]
    fn harmony_tool_calls_and_plain_text() {
        let text = "<|channel|>analysis<|message|>Need weather.<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>";
        let got = run(ReasoningFormat::Harmony, false, &[text]);
        assert_eq!(got.reasoning, "Need weather.");
        assert_eq!(got.content, "");
        assert_eq!(got.calls, vec![HarmonyCall { name: "get_weather".into(), arguments: "{\"city\":\"Paris\"}".into() }]);
        // The recipient may come before the channel (as the template writes calls), even
        // first thing after the prompt's `<|start|>assistant`, and the call may end the text.
        let got = run(ReasoningFormat::Harmony, false, &["<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}"]);
        assert_eq!(got.calls, vec![HarmonyCall { name: "f".into(), arguments: "{}".into() }]);
        let got = run(ReasoningFormat::Harmony, false, &[" to=functions.get_weather", "<|channel|>", "commentary json", "<|message|>", "{\"city\":\"Oslo\"}", "<|call|>"]);
        assert_eq!(got.calls, vec![HarmonyCall { name: "get_weather".into(), arguments: "{\"city\":\"Oslo\"}".into() }]);
        assert_eq!((got.content.as_str(), got.reasoning.as_str()), ("", ""));
        // Long arguments token by token, the end marker split across two pieces.
        let args = format!("{{\"code\":\"{}\"}}", "x = 1\\n".repeat(400));
        let mut pieces: Vec<String> = vec!["<|channel|>commentary to=functions.run <|constrain|>json<|message|>".into()];
        pieces.extend(args.as_bytes().chunks(7).map(|c| String::from_utf8(c.to_vec()).unwrap()));
        pieces.extend(["<|ca".to_string(), "ll|>".to_string()]);
        let got = run(ReasoningFormat::Harmony, false, &pieces.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(got.calls, vec![HarmonyCall { name: "run".into(), arguments: args.clone() }]);
        // A model that writes no header at all: its text is the answer.
        assert_eq!(run(ReasoningFormat::Harmony, false, &["Plain answer", " here."]).content, "Plain answer here.");
        // A commentary preamble to the user is answer text.
        assert_eq!(run(ReasoningFormat::Harmony, false, &["<|channel|>commentary<|message|>Checking…"]).content, "Checking…");
    }

    #[test]
    fn without_a_format_text_passes_through() {
        assert_eq!(run(ReasoningFormat::None, false, &["<think>", "x</think>y"]).content, "<think>x</think>y");
    }
}
