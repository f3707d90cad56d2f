//! Tokenizer and detokenizer: llama.cpp's own, loaded vocab-only from the GGUF (no
//! weights), so hearth tokenizes exactly as llama.cpp does for every vocabulary type.

use std::path::Path;

use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;

use crate::{Error, Result};

pub struct Tokenizer {
    model: LlamaModel,
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
        Ok(Tokenizer { model })
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
        let vocab = self.model.vocab();
        vocab.tokenize(text.as_bytes(), vocab.should_add_bos(), parse_special).into_iter().map(|t| t.0).collect()
    }

    /// Raw bytes of one token (may be part of a UTF-8 character). Control tokens render as
    /// empty so they never leak into text.
    pub fn token_bytes(&self, token: i32) -> Vec<u8> {
        self.model.vocab().token_to_piece(LlamaToken(token), false, None)
    }

    /// Text of a token sequence; invalid UTF-8 is replaced.
    pub fn detokenize(&self, tokens: &[i32]) -> String {
        let toks: Vec<LlamaToken> = tokens.iter().map(|&t| LlamaToken(t)).collect();
        String::from_utf8_lossy(&self.model.vocab().detokenize(&toks, false, false)).into_owned()
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

    /// Whatever is left at the end of generation.
    pub fn finish(&mut self) -> String {
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        rest
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
        assert_eq!(s.finish(), "\u{FFFD}");
    }
}
