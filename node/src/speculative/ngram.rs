//! Prompt lookup (n-gram) proposals: the longest suffix of a sequence's tokens, between the
//! configured lengths, found earlier in those tokens proposes the tokens that followed its most
//! recent earlier occurrence. Copy-heavy work (editing a given file, quoting a document) repeats
//! long runs of its prompt, which this finds without a second model.

use super::{ProposeInput, Proposer};

pub struct NgramProposer {
    min: usize,
    max: usize,
}

impl NgramProposer {
    /// Matches suffixes of `min..=max` tokens (longest first).
    pub fn new(min: usize, max: usize) -> Self {
        Self {
            min: min.max(1),
            max: max.max(min.max(1)),
        }
    }
}

impl Proposer for NgramProposer {
    fn name(&self) -> &'static str {
        "ngram"
    }

    fn propose(&mut self, inputs: &[ProposeInput<'_>], out: &mut [Vec<u32>]) {
        for (input, out) in inputs.iter().zip(out) {
            out.clear();
            if let Some(from) = lookup(input.tokens, self.min, self.max) {
                let end = (from + input.max).min(input.tokens.len());
                out.extend_from_slice(&input.tokens[from..end]);
            }
        }
    }
}

/// Where the continuation of `tokens`' suffix starts: for the longest suffix of `min..=max`
/// tokens that also occurs earlier, the position just after its most recent earlier occurrence.
fn lookup(tokens: &[u32], min: usize, max: usize) -> Option<usize> {
    let len = tokens.len();
    for n in (min..=max.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        // An occurrence ending before the suffix itself starts its last token, so that at least
        // one token follows it.
        let found = (0..len - n)
            .rev()
            .find(|&start| &tokens[start..start + n] == suffix);
        if let Some(start) = found {
            return Some(start + n);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn propose(tokens: &[u32], min: usize, max: usize, k: usize) -> Vec<u32> {
        let mut out = vec![Vec::new()];
        NgramProposer::new(min, max).propose(
            &[ProposeInput {
                id: 1,
                tokens,
                max: k,
            }],
            &mut out,
        );
        out.pop().unwrap()
    }

    #[test]
    fn the_longest_suffix_proposes_what_followed_its_latest_occurrence() {
        // "1 2 3" occurred twice: the later continuation (9 9) wins over the earlier (4 5).
        let tokens = [1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 7, 1, 2, 3];
        assert_eq!(propose(&tokens, 1, 3, 2), vec![9, 9]);
        // The proposal stops at the end of the tokens.
        assert_eq!(propose(&tokens, 1, 3, 8), vec![9, 9, 7, 1, 2, 3]);
        // A longer match beats a more recent shorter one: "7 8" matches at 0, "8" alone at 4.
        let tokens = [7, 8, 1, 2, 8, 5, 7, 8];
        assert_eq!(propose(&tokens, 1, 2, 1), vec![1]);
        assert_eq!(propose(&tokens, 1, 1, 1), vec![5]);
        // Below the minimum length nothing matches.
        assert!(propose(&[1, 2, 3, 4, 3], 2, 4, 3).is_empty());
        assert_eq!(propose(&[1, 2, 3, 4, 3], 1, 4, 3), vec![4, 3]);
        // Nothing to match against.
        assert!(propose(&[5], 1, 4, 3).is_empty());
        assert!(propose(&[], 1, 4, 3).is_empty());
        // A run of one token proposes itself.
        assert_eq!(propose(&[6, 6, 6], 1, 2, 4), vec![6]);
    }
}
