//! Prefixes a request asks to keep (Anthropic's `cache_control`, Converse's `cachePoint`):
//! once the request has run, the whole KV blocks of its prompt up to the last mark are pinned
//! for the mark's lifetime, so they are parked in the host and disk tiers rather than dropped,
//! and a later request with the same prefix restores them. The usage reports what was read from
//! the cache and what this request wrote into it.
//!
//! Through a cluster router every node pins the part of the prefix it holds (the request ran
//! where the router placed it).

use std::time::Duration;

use strata_engine_api::kv::{BlockHash, prompt_block_hashes};

use crate::state::AppState;

/// A prefix to pin once its request has run.
#[derive(Debug, Clone)]
pub struct Park {
    name: String,
    hashes: Vec<BlockHash>,
    /// Tokens of the whole blocks pinned.
    tokens: u32,
    ttl: Duration,
}

impl Park {
    /// The whole blocks of `prompt[..prefix]` under the tenant's `salt`, pinned for `ttl`;
    /// `None` when the prefix holds no whole block. The pin is named by the prefix, so
    /// repeating a request renews it instead of adding one.
    pub fn new(
        state: &AppState,
        prompt: &[u32],
        prefix: usize,
        salt: u64,
        ttl: Duration,
    ) -> Option<Self> {
        let block_size = state.engine.block_size();
        let whole = prefix.min(prompt.len()) / block_size * block_size;
        let hashes = prompt_block_hashes(&prompt[..whole], block_size, salt);
        let last = hashes.last()?;
        Some(Self {
            name: format!("parked-{salt:016x}-{:032x}", last.0),
            tokens: u32::try_from(whole).unwrap_or(u32::MAX),
            hashes,
            ttl,
        })
    }

    /// Pins the prefix (without waiting for the engine or the nodes) and returns the tokens
    /// this request wrote into the cache: those of the parked prefix it did not read from it.
    pub fn apply(self, state: &AppState, cached_tokens: u32) -> u32 {
        let written = self.tokens.saturating_sub(cached_tokens);
        state.engine.pin_detached(self.name, self.hashes, self.ttl);
        written
    }
}

/// The marks of one request, as its surface finds them: the longest lifetime any asks for, and
/// the last message holding one (`None`: only the system prompt or the tools are marked).
#[derive(Debug, Default)]
pub struct Marks {
    longest: Option<Duration>,
    last_message: Option<usize>,
}

impl Marks {
    /// Notes a block's mark (`life`, if it has one), in message `message` if it is in one.
    pub fn note(&mut self, life: Option<Duration>, message: Option<usize>) {
        if let Some(life) = life {
            self.longest = Some(self.longest.map_or(life, |l| l.max(life)));
            if message.is_some() {
                self.last_message = message;
            }
        }
    }

    /// The longest lifetime asked for and the last marked message; `None` without marks.
    pub fn found(&self) -> Option<(Duration, Option<usize>)> {
        self.longest.map(|ttl| (ttl, self.last_message))
    }
}

/// The lifetimes a mark may ask for: `5m` (the default) and `1h`, as Anthropic and Bedrock
/// name them.
pub fn mark_ttl(name: &str) -> Option<Duration> {
    match name {
        "5m" => Some(Duration::from_secs(300)),
        "1h" => Some(Duration::from_secs(3600)),
        _ => None,
    }
}

/// The default lifetime of a mark.
pub const DEFAULT_MARK_TTL: &str = "5m";

/// How many leading tokens `a` and `b` share.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_keep_the_longest_lifetime_and_the_last_marked_message() {
        let mut marks = Marks::default();
        assert_eq!(marks.found(), None);
        marks.note(Some(Duration::from_secs(3600)), None);
        marks.note(Some(Duration::from_secs(300)), Some(1));
        marks.note(None, Some(4));
        assert_eq!(marks.found(), Some((Duration::from_secs(3600), Some(1))));
    }

    #[test]
    fn common_prefixes() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4]), 2);
        assert_eq!(common_prefix(&[1, 2], &[1, 2, 3]), 2);
        assert_eq!(common_prefix(&[], &[1]), 0);
    }
}
