//! Deciding when generation stops: stop token ids, and stop strings over streamed text.
//!
//! Stop strings are matched on the detokenized text, which arrives in pieces that need not line up
//! with the stop strings. [`StopStrings`] holds back exactly the tail that could still grow into a
//! stop string and releases it as soon as it cannot, so a client never sees text that later turns
//! out to be (part of) a stop string, and sees everything else as early as possible.

use strata_protocol::SamplingParams;

/// True when `token` ends generation: one of the request's stop token ids, or an end-of-sequence
/// id of the model unless the request asked to ignore those.
pub fn is_stop_token(token: u32, params: &SamplingParams, eos_ids: &[u32]) -> bool {
    params.stop_token_ids.contains(&token) || (!params.ignore_eos && eos_ids.contains(&token))
}

/// What one [`StopStrings::push`] lets through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StopOutcome<'a> {
    /// Text that is safe to send now (borrowed from the matcher until the next call).
    pub emit: &'a str,
    /// A stop string completed: `emit` is everything before it, and the stream is over.
    pub stopped: bool,
}

/// Streaming stop-string matcher for one sequence.
///
/// Matching rule: generation stops at the first point in the stream where some stop string has
/// just completed; if several complete at that same point, the one starting earliest wins (so the
/// most text is dropped). Because the rule looks only at where matches end, the result does not
/// depend on how the text was split into pushes.
///
/// Invariant: `buffer[emitted..]` is the longest suffix of the text seen so far that is a proper
/// prefix of some stop string. Every occurrence of a stop string therefore lies inside
/// `buffer[emitted..]` plus the next push, which is all that is ever searched.
#[derive(Debug, Clone, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    buffer: String,
    /// Bytes at the front of `buffer` handed out by the last `push`; dropped at the next call.
    emitted: usize,
    stopped: bool,
}

impl StopStrings {
    /// Empty stop strings are ignored (they would stop before the first character) and duplicates
    /// are kept once.
    pub fn new(stops: &[String]) -> Self {
        let mut kept: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        kept.sort_unstable();
        kept.dedup();
        Self {
            stops: kept,
            ..Self::default()
        }
    }

    /// Whether a stop string has matched; every later push emits nothing.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }

    /// Feeds the next piece of generated text.
    pub fn push(&mut self, text: &str) -> StopOutcome<'_> {
        self.buffer.drain(..self.emitted);
        self.emitted = 0;
        if self.stopped {
            return StopOutcome {
                emit: "",
                stopped: true,
            };
        }
        self.buffer.push_str(text);
        if let Some(start) = self.first_match_start() {
            self.buffer.truncate(start);
            self.emitted = start;
            self.stopped = true;
            return StopOutcome {
                emit: &self.buffer,
                stopped: true,
            };
        }
        self.emitted = self.buffer.len() - self.held_len();
        StopOutcome {
            emit: &self.buffer[..self.emitted],
            stopped: false,
        }
    }

    /// Ends the stream without a match: returns the text still held back. Empty once stopped.
    pub fn finish(&mut self) -> String {
        self.buffer.drain(..self.emitted);
        self.emitted = 0;
        if self.stopped {
            self.buffer.clear();
        }
        std::mem::take(&mut self.buffer)
    }

    /// Start of the winning match in `buffer`, if any stop string occurs: earliest end, then
    /// earliest start. A stop string's first occurrence is also the one ending first.
    fn first_match_start(&self) -> Option<usize> {
        self.stops
            .iter()
            .filter_map(|stop| {
                self.buffer
                    .find(stop.as_str())
                    .map(|start| (start + stop.len(), start))
            })
            .min()
            .map(|(_, start)| start)
    }

    /// Length in bytes of the longest suffix of `buffer` that is a proper prefix of a stop string.
    ///
    /// Only char-boundary prefixes of the stop are tried; a suffix equal to such a prefix starts
    /// with the same lead byte, so it also starts on a char boundary of `buffer` and slicing there
    /// never splits a character.
    fn held_len(&self) -> usize {
        let mut held = 0;
        for stop in &self.stops {
            let longest = (stop.len() - 1).min(self.buffer.len());
            let found = (held + 1..=longest)
                .rev()
                .find(|&k| stop.is_char_boundary(k) && self.buffer.ends_with(&stop[..k]));
            if let Some(k) = found {
                held = k;
            }
        }
        held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(list: &[&str]) -> StopStrings {
        StopStrings::new(&list.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    /// Pushes every piece; returns (emits in order, stopped, what finish returned).
    fn feed(matcher: &mut StopStrings, pieces: &[&str]) -> (Vec<String>, bool, String) {
        let mut emits = Vec::new();
        let mut stopped = false;
        for piece in pieces {
            let out = matcher.push(piece);
            emits.push(out.emit.to_string());
            stopped = out.stopped;
        }
        (emits, stopped, matcher.finish())
    }

    #[test]
    fn stop_inside_one_push_drops_it_and_the_rest() {
        let mut m = stops(&["</s>"]);
        assert_eq!(
            m.push("hello</s>world"),
            StopOutcome {
                emit: "hello",
                stopped: true
            }
        );
        assert!(m.is_stopped());
        assert_eq!(
            m.push("more"),
            StopOutcome {
                emit: "",
                stopped: true
            }
        );
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn stop_spanning_three_pushes() {
        let (emits, stopped, rest) = feed(&mut stops(&["STOP"]), &["abc S", "T", "OP tail"]);
        assert_eq!(emits, ["abc ", "", ""]);
        assert!(stopped);
        assert_eq!(rest, "");
    }

    #[test]
    fn held_prefix_is_released_when_it_diverges() {
        let (emits, stopped, rest) = feed(&mut stops(&["STOP"]), &["ab ST", "O", "P!"]);
        assert_eq!(emits, ["ab ", "", ""]);
        assert!(stopped);
        assert_eq!(rest, "");
        let (emits, stopped, rest) = feed(&mut stops(&["STOP"]), &["ab ST", "O", "x", "S"]);
        assert_eq!(emits, ["ab ", "", "STOx", ""]);
        assert!(!stopped);
        assert_eq!(rest, "S");
    }

    #[test]
    fn overlapping_stops_stop_where_the_first_one_completes() {
        let (emits, stopped, _) = feed(&mut stops(&["ab", "bc"]), &["xa", "bc"]);
        assert_eq!((emits.concat(), stopped), ("x".to_string(), true));
        let (emits, stopped, _) = feed(&mut stops(&["ab", "bc"]), &["xb", "c"]);
        assert_eq!(
            (emits, stopped),
            (vec!["x".to_string(), String::new()], true)
        );
        // "bc" completes before "abcd" could: stop there, whichever way the text is split.
        for pieces in [&["abcd"][..], &["ab", "cd"], &["a", "b", "c", "d"]] {
            let (emits, stopped, _) = feed(&mut stops(&["abcd", "bc"]), pieces);
            assert_eq!(
                (emits.concat(), stopped),
                ("a".to_string(), true),
                "{pieces:?}"
            );
        }
        // Completing at the same point, the one starting earlier wins.
        assert_eq!(stops(&["c", "abc"]).push("xabc").emit, "x");
    }

    #[test]
    fn unicode_is_never_split() {
        let (emits, stopped, rest) = feed(&mut stops(&["é!"]), &["caf", "é", "?"]);
        assert_eq!(emits, ["caf", "", "é?"]);
        assert!(!stopped);
        assert_eq!(rest, "");
        let (emits, stopped, _) = feed(&mut stops(&["日本"]), &["今日", "は日", "本語"]);
        assert_eq!(emits, ["今", "日は", ""]);
        assert!(stopped);
        // A stop that shares only the first byte of a character holds nothing back.
        let mut m = stops(&["\u{e9}x"]); // é = C3 A9; è = C3 A8
        assert_eq!(m.push("è").emit, "è");
    }

    #[test]
    fn finish_flushes_the_held_text() {
        let mut m = stops(&["<|end|>"]);
        assert_eq!(m.push("answer <|en").emit, "answer ");
        assert_eq!(m.finish(), "<|en");
    }

    #[test]
    fn empty_and_duplicate_stops_are_ignored() {
        let mut m = stops(&["", "x", "x"]);
        assert_eq!(m.push("ab").emit, "ab");
        assert_eq!(
            m.push("cxd"),
            StopOutcome {
                emit: "c",
                stopped: true
            }
        );
        let mut none = stops(&[""]);
        assert_eq!(
            none.push("abc"),
            StopOutcome {
                emit: "abc",
                stopped: false
            }
        );
    }

    #[test]
    fn emits_and_finish_reassemble_the_input_whatever_the_split() {
        let text = "the quick <st brown <sto fox <stXp jumps é<s";
        let list = ["<stop>", "<stX!", "xyz"];
        let chars: Vec<&str> = text
            .char_indices()
            .map(|(i, c)| &text[i..i + c.len_utf8()])
            .collect();
        let halves = [&text[..13], &text[13..]];
        for pieces in [vec![text], chars, halves.to_vec()] {
            let (emits, stopped, rest) = feed(&mut stops(&list), &pieces);
            assert!(!stopped);
            assert_eq!(emits.concat() + &rest, text, "{pieces:?}");
        }
        assert_eq!(
            stops(&list).push(text).emit,
            "the quick <st brown <sto fox <stXp jumps é"
        );
    }

    #[test]
    fn stop_result_does_not_depend_on_the_split() {
        let text = "one two <e three <end> four";
        let list = ["<end>", "d> f", "thr"];
        let whole = feed(&mut stops(&list), &[text]);
        let chars: Vec<&str> = text
            .char_indices()
            .map(|(i, c)| &text[i..i + c.len_utf8()])
            .collect();
        let split = feed(&mut stops(&list), &chars);
        assert_eq!(
            (whole.0.concat(), whole.1),
            ("one two <e ".to_string(), true)
        );
        assert_eq!((split.0.concat(), split.1), (whole.0.concat(), whole.1));
    }

    #[test]
    fn stop_tokens_respect_ignore_eos() {
        let mut params = SamplingParams {
            stop_token_ids: vec![7],
            ..SamplingParams::default()
        };
        assert!(is_stop_token(7, &params, &[2]));
        assert!(is_stop_token(2, &params, &[2]));
        assert!(!is_stop_token(3, &params, &[2]));
        params.ignore_eos = true;
        assert!(!is_stop_token(2, &params, &[2]));
        assert!(is_stop_token(7, &params, &[2]));
    }
}
