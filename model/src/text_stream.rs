//! Token ids → the text a client may see: incremental detokenization plus stop strings, as the
//! front door applies them to an engine's token stream.

use crate::stop::StopStrings;
use crate::tokenizer::{IncrementalDecoder, Tokenizer, TokenizerError};

/// What one pushed token released.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextPiece {
    pub text: String,
    /// A stop string completed: `text` ends before it and the stream is over.
    pub stopped: bool,
}

pub struct TextStream {
    decoder: IncrementalDecoder,
    stops: StopStrings,
}

impl TextStream {
    /// `prompt` gives the detokenizer its left context (so a leading space decodes right).
    pub fn new(prompt: &[u32], stops: &[String]) -> Self {
        Self::with_special_tokens(prompt, stops, false)
    }

    /// [`TextStream::new`], keeping the tokenizer's special tokens in the text when
    /// `keep_special` (a tool-call format whose markers are special tokens needs them).
    pub fn with_special_tokens(prompt: &[u32], stops: &[String], keep_special: bool) -> Self {
        Self {
            decoder: IncrementalDecoder::with_context(!keep_special, prompt),
            stops: StopStrings::new(stops),
        }
    }

    pub fn push(&mut self, tokenizer: &Tokenizer, token: u32) -> Result<TextPiece, TokenizerError> {
        let piece = self.decoder.push(tokenizer, token)?;
        let outcome = self.stops.push(&piece);
        Ok(TextPiece {
            text: outcome.emit.to_string(),
            stopped: outcome.stopped,
        })
    }

    /// The text still held back when generation ended without a stop string.
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<TextPiece, TokenizerError> {
        if self.stops.is_stopped() {
            return Ok(TextPiece {
                text: String::new(),
                stopped: true,
            });
        }
        let tail = self.decoder.finish(tokenizer)?;
        let outcome = self.stops.push(&tail);
        let mut text = outcome.emit.to_string();
        let stopped = outcome.stopped;
        if !stopped {
            text.push_str(&self.stops.finish());
        }
        Ok(TextPiece { text, stopped })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Architecture;
    use crate::synth::{SynthSpec, synthesize};

    fn tokenizer() -> (tempfile::TempDir, Tokenizer) {
        let dir = tempfile::tempdir().unwrap();
        synthesize(&SynthSpec::tiny(Architecture::Llama, 1), dir.path(), None).unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        (dir, tok)
    }

    fn run(tok: &Tokenizer, text: &str, stops: &[String]) -> (String, bool) {
        let ids = tok.encode(text, false).unwrap();
        let mut stream = TextStream::new(&[], stops);
        let mut out = String::new();
        for id in ids {
            let piece = stream.push(tok, id).unwrap();
            out.push_str(&piece.text);
            if piece.stopped {
                return (out, true);
            }
        }
        let piece = stream.finish(tok).unwrap();
        out.push_str(&piece.text);
        (out, piece.stopped)
    }

    #[test]
    fn stop_string_spanning_tokens_cuts_before_it() {
        let (_d, tok) = tokenizer();
        // Every byte is one token here, so "END" spans three tokens; "é" is two.
        let (text, stopped) = run(&tok, "café au lait END more", &["END".into()]);
        assert_eq!((text.as_str(), stopped), ("café au lait ", true));
    }

    #[test]
    fn special_tokens_are_kept_only_when_asked() {
        let (_d, tok) = tokenizer();
        // "<|im_start|>" is a special token of the synthesized tokenizer, "<tool_call>" is not.
        let ids = tok.encode("a<|im_start|>b<tool_call>", false).unwrap();
        let decode = |keep: bool| {
            let mut stream = TextStream::with_special_tokens(&[], &[], keep);
            let mut out = String::new();
            for &id in &ids {
                out.push_str(&stream.push(&tok, id).unwrap().text);
            }
            out.push_str(&stream.finish(&tok).unwrap().text);
            out
        };
        assert_eq!(decode(true), "a<|im_start|>b<tool_call>");
        // The canary: the default decoder drops the special token.
        assert_eq!(decode(false), "ab<tool_call>");
    }

    #[test]
    fn without_a_match_everything_comes_out() {
        let (_d, tok) = tokenizer();
        let (text, stopped) = run(&tok, "naïve ENDING? no: EN", &["END!".into()]);
        assert_eq!((text.as_str(), stopped), ("naïve ENDING? no: EN", false));
    }
}
