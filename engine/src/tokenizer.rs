//! Tokenizer and detokenizer: llama.cpp's own, loaded vocab-only from the GGUF (no
//! weights), so hearth tokenizes exactly as llama.cpp does for every vocabulary type.

use std::path::Path;

use aho_corasick::AhoCorasick;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;
use llama_cpp_2::token_type::LlamaTokenAttr;

use crate::chat_template::RenderedChat;
use crate::{Error, Result};

pub struct Tokenizer {
    model: LlamaModel,
    /// Finds the text of the tokens that `parse_special` turns into tokens (control and
    /// unknown ones; llama.cpp always matches user-defined tokens). `None`: the vocabulary
    /// has none.
    control_text: Option<AhoCorasick>,
    /// The longest text one token stands for; 0 where that bounds nothing (vocabularies
    /// that normalize text, such as collapsing whitespace, before tokenizing).
    max_piece_bytes: usize,
}

impl Tokenizer {
    pub fn load(path: impl AsRef<Path>) -> Result<Tokenizer> {
        let backend = crate::backend::init();
        let path = path.as_ref();
        // llama.cpp's loader asserts on a missing file in debug builds; check first.
        if !path.is_file() {
            return Err(Error::Io { path: path.to_path_buf(), source: std::io::Error::from(std::io::ErrorKind::NotFound) });
        }
        let params = LlamaModelParams::default().with_vocab_only(true);
        let model = LlamaModel::load_from_file(backend, path, &params).map_err(|e| Error::Llama(format!("loading the vocabulary of {}: {e}", path.display())))?;
        let control_text = control_text(&model)?;
        let max_piece_bytes = max_piece_bytes(&model);
        Ok(Tokenizer { model, control_text, max_piece_bytes })
    }

    /// The vocab-only llama.cpp model, for samplers that need the vocabulary (grammar).
    pub fn llama_model(&self) -> &LlamaModel {
        &self.model
    }

    pub fn n_vocab(&self) -> usize {
        self.model.vocab().n_tokens().max(0) as usize
    }

    /// `parse_special` turns control-token text (`<|im_start|>`) into its token, which a
    /// rendered chat template needs and raw user text must not get. BOS is added when the
    /// model asks for it.
    pub fn tokenize(&self, text: &str, parse_special: bool) -> Vec<i32> {
        self.tokenize_with(text, parse_special, self.model.vocab().should_add_bos())
    }

    /// [`Tokenizer::tokenize`] with the choice of special tokens made by the caller:
    /// `add_special` adds what llama.cpp's `add_special` adds (BOS, and EOS/SEP where the
    /// vocabulary asks for them), nothing when false (a continuation, a prefill).
    pub fn tokenize_with(&self, text: &str, parse_special: bool, add_special: bool) -> Vec<i32> {
        self.model.vocab().tokenize(text.as_bytes(), add_special, parse_special).into_iter().map(|t| t.0).collect()
    }

    /// How many tokens `bytes` of text take at least (0 if the vocabulary gives no bound), so
    /// that a prompt far over the context is refused without tokenizing it.
    pub fn min_tokens(&self, bytes: usize) -> usize {
        bytes.checked_div(self.max_piece_bytes).unwrap_or(0)
    }

    /// A rendered chat prompt as tokens, with control tokens parsed only in the template's
    /// own text: control-token text in the client's text (`<|im_start|>system` typed into a
    /// message) stays ordinary text. A prompt whose client text holds no control-token text
    /// is tokenized exactly as `tokenize(&chat.text, true)` does.
    pub fn tokenize_chat(&self, chat: &RenderedChat) -> Result<Vec<i32>> {
        if !self.client_text_has_control(chat) {
            return Ok(self.tokenize(&chat.text, true));
        }
        let pieces = chat.pieces.as_ref().ok_or_else(|| {
            Error::ChatTemplate("a message holds special-token text, and this model's chat template cuts message text apart so that hearth cannot keep it from being read as control tokens".into())
        })?;
        // Piece by piece: the template's pieces with control tokens, the client's without.
        // Boundaries may tokenize slightly differently from one whole string, which is fine
        // for the text of a forgery attempt.
        let vocab = self.model.vocab();
        let add_special = vocab.should_add_bos();
        let mut tokens = Vec::with_capacity(chat.text.len() / 3);
        if add_special {
            tokens.push(vocab.bos().0);
        }
        for piece in pieces {
            tokens.extend(vocab.tokenize(piece.text.as_bytes(), false, !piece.client).into_iter().map(|t| t.0));
        }
        if add_special && vocab.should_add_eos() {
            tokens.push(vocab.eos().0);
        }
        Ok(tokens)
    }

    /// Whether parsing control tokens in the whole prompt would turn some of the client's
    /// text (or text spanning it and the template's) into a control token.
    fn client_text_has_control(&self, chat: &RenderedChat) -> bool {
        let Some(control) = &self.control_text else { return false };
        let pieces = match &chat.pieces {
            Some(pieces) if chat.exact => pieces,
            // Without exact positions, look inside each client string.
            _ => return chat.client_text.iter().any(|t| control.is_match(t)),
        };
        // Byte ranges of the template's own pieces in `chat.text`.
        let mut template = Vec::new();
        let mut at = 0;
        for p in pieces {
            if !p.client {
                template.push(at..at + p.text.len());
            }
            at += p.text.len();
        }
        control.find_overlapping_iter(&chat.text).any(|m| {
            let i = template.partition_point(|r| r.end <= m.start());
            template.get(i).is_none_or(|r| !(r.start <= m.start() && m.end() <= r.end))
        })
    }

    /// Raw bytes of one token (may be part of a UTF-8 character). Control tokens render as
    /// empty so they never leak into text.
    pub fn token_bytes(&self, token: i32) -> Vec<u8> {
        self.model.vocab().token_to_piece(LlamaToken(token), false, None)
    }

    /// Text of a token sequence; invalid UTF-8 is replaced.
    pub fn detokenize(&self, tokens: &[i32]) -> String {
        self.detokenize_with(tokens, false)
    }

    /// Text of a token sequence, control tokens written out (`<|im_start|>`) when
    /// `render_special`, else left out.
    pub fn detokenize_with(&self, tokens: &[i32], render_special: bool) -> String {
        let toks: Vec<LlamaToken> = tokens.iter().map(|&t| LlamaToken(t)).collect();
        String::from_utf8_lossy(&self.model.vocab().detokenize(&toks, false, render_special)).into_owned()
    }

    /// End of generation (EOS, EOT, or the template's end-of-turn token).
    pub fn is_eog(&self, token: i32) -> bool {
        self.model.vocab().is_eog(LlamaToken(token))
    }

    pub fn bos_text(&self) -> String {
        self.special_text(self.model.vocab().bos())
    }

    pub fn eos_text(&self) -> String {
        self.special_text(self.model.vocab().eos())
    }

    fn special_text(&self, t: LlamaToken) -> String {
        if t.0 < 0 {
            return String::new();
        }
        String::from_utf8_lossy(&self.model.vocab().token_to_piece(t, true, None)).into_owned()
    }

    pub fn chat_template_source(&self) -> Option<String> {
        self.model.meta_val_str("tokenizer.chat_template").ok()
    }
}

/// A matcher for the text of every control and unknown token of the vocabulary.
fn control_text(model: &LlamaModel) -> Result<Option<AhoCorasick>> {
    let vocab = model.vocab();
    let texts: Vec<Vec<u8>> = vocab
        .tokens()
        .filter(|&t| {
            let attr = vocab.attr(t).0;
            attr.contains(LlamaTokenAttr::Control) || attr.contains(LlamaTokenAttr::Unknown)
        })
        .filter_map(|t| vocab.text(t).map(|c| c.to_bytes().to_vec()))
        .filter(|t| !t.is_empty())
        .collect();
    if texts.is_empty() {
        return Ok(None);
    }
    AhoCorasick::new(texts).map(Some).map_err(|e| Error::Llama(format!("indexing the control tokens: {e}")))
}

/// The longest piece of text a token of a BPE or SPM vocabulary stands for. In those, every
/// byte of a text ends up in some token's piece, so text bytes / this bounds the token count
/// from below (a special token that strips the whitespace around it aside, which takes an
/// absurd prompt to matter).
fn max_piece_bytes(model: &LlamaModel) -> usize {
    // Read from the file, not `vocab_type()`: llama-cpp-2 panics on the types it has no
    // name for (BERT's WordPiece, T5's Unigram), and embedding models use them.
    let vocab = model.vocab();
    if !matches!(model.meta_val_str("tokenizer.ggml.model").as_deref(), Ok("gpt2" | "llama" | "gemma4")) {
        return 0;
    }
    let mut piece = Vec::new();
    vocab
        .tokens()
        .map(|t| {
            piece.clear();
            vocab.token_to_piece_into(t, &mut piece, true, None);
            piece.len()
        })
        .max()
        .unwrap_or(0)
}

/// Turns a stream of token bytes into text on UTF-8 boundaries: a character split across
/// tokens is held back until it is complete, so streamed text never shows U+FFFD halves.
#[derive(Debug, Default)]
pub struct TextStream {
    pending: Vec<u8>,
}

impl TextStream {
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).expect("validated prefix"));
                    match e.error_len() {
                        // Incomplete character at the end: wait for the next token.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        // Bytes no continuation can fix: replace them and go on.
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + bad);
                        }
                    }
                }
            }
        }
    }

    /// Whatever is left at the end of generation: nothing, since `push` keeps back only
    /// the first bytes of a character still to come. Generation ended before it came (a
    /// length cut in the middle of an emoji), and half a character has no text: written
    /// out it was a U+FFFD that clients kept (Open WebUI stored "📌\u{FFFD}" as a chat's
    /// emoji). Every API's text comes through here, streamed or whole.
    pub fn finish(&mut self) -> String {
        self.pending.clear();
        String::new()
    }
}

#[cfg(test)]
mod tests {
    use super::TextStream;

    #[test]
    fn split_characters_wait_for_their_last_byte() {
        let mut s = TextStream::default();
        let snowman = "☃".as_bytes(); // 3 bytes
        assert_eq!(s.push(b"a"), "a");
        assert_eq!(s.push(&snowman[..1]), "");
        assert_eq!(s.push(&snowman[1..2]), "");
        assert_eq!(s.push(&[snowman[2], b'b']), "☃b");
        assert_eq!(s.finish(), "");
    }

    #[test]
    fn invalid_bytes_become_replacement_characters() {
        let mut s = TextStream::default();
        assert_eq!(s.push(&[b'x', 0xFF, b'y']), "x\u{FFFD}y");
        assert_eq!(s.push(&[0xE2, 0x98]), "");
        // The snowman's last byte never came: the half character is dropped.
        assert_eq!(s.finish(), "");
    }
}
