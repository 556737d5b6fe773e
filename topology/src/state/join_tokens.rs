//! Join tokens: the hashes of one-use secrets that admit a new member.
//!
//! `cluster init` commits a token's SHA-256 (never the secret). A joiner presents the secret
//! to the member holding the CA key, which commits `ConsumeJoinToken` with the member id it
//! assigns before it signs anything: the token is spent in the log, so two joiners can never
//! both use it, and a replayed join is refused on every replica alike.
//!
//! A token expires a TTL after it was issued. Both ends are group time — the largest clock
//! stamped into an applied entry — never a replica's own clock: the issue is stamped by its
//! proposer, the spend by the member admitting the joiner, and every replica compares the
//! same two numbers. An expired token is refused and stays unspent, so it still shows in the
//! state as issued and never used.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::Rejection;
use super::members::NodeId;

/// How long a token admits a joiner when its issuer names no TTL: one hour.
pub const DEFAULT_JOIN_TOKEN_TTL_MS: u64 = 60 * 60 * 1_000;

/// One token, by hash.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinToken {
    pub issued_ms: u64,
    /// Group time from which the token admits no one. Tokens stored before expiry existed
    /// read as 0: expired, so nothing issued without a bound admits anyone now.
    #[serde(default)]
    pub expires_ms: u64,
    /// The member admitted with it, once spent.
    pub consumed_by: Option<NodeId>,
}

impl JoinToken {
    /// Whether the token admits no one at group time `now_ms`.
    pub fn expired(&self, now_ms: u64) -> bool {
        now_ms >= self.expires_ms
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinTokens {
    by_sha256: BTreeMap<String, JoinToken>,
}

fn is_sha256_hex(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl JoinTokens {
    pub fn tokens(&self) -> &BTreeMap<String, JoinToken> {
        &self.by_sha256
    }

    /// Whether some token already admitted member `id`.
    pub fn admitted(&self, id: NodeId) -> bool {
        self.by_sha256.values().any(|t| t.consumed_by == Some(id))
    }

    /// Records a token issued at `now_ms` that admits a joiner for `ttl_ms`.
    pub fn put(&mut self, sha256: &str, now_ms: u64, ttl_ms: u64) -> Result<(), Rejection> {
        if !is_sha256_hex(sha256) {
            return Err(Rejection::InvalidName(sha256.to_string()));
        }
        if self.by_sha256.contains_key(sha256) {
            return Err(Rejection::AlreadyExists("join token".into()));
        }
        self.by_sha256.insert(
            sha256.to_string(),
            JoinToken {
                issued_ms: now_ms,
                expires_ms: now_ms.saturating_add(ttl_ms),
                consumed_by: None,
            },
        );
        Ok(())
    }

    /// Spends a token for member `id` at group time `now_ms`. Refused, spending nothing, for an
    /// unknown, spent or expired token, or an id some token already admitted.
    pub fn consume(&mut self, sha256: &str, id: NodeId, now_ms: u64) -> Result<(), Rejection> {
        if self.admitted(id) {
            return Err(Rejection::MemberExists(id));
        }
        let token = self
            .by_sha256
            .get_mut(sha256)
            .ok_or_else(|| Rejection::NotFound("join token".into()))?;
        if token.consumed_by.is_some() {
            return Err(Rejection::AlreadyExists(
                "a member admitted with this join token".into(),
            ));
        }
        if token.expired(now_ms) {
            return Err(Rejection::JoinTokenExpired {
                expired_ms: token.expires_ms,
                now_ms,
            });
        }
        token.consumed_by = Some(id);
        Ok(())
    }
}

/// Milliseconds since the Unix epoch, shown as a UTC time (`2026-12-03T12:24:16.123Z`), so
/// that an operator reading an expiry does not have to convert it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnixMillis(pub u64);

impl fmt::Display for UnixMillis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match i64::try_from(self.0)
            .ok()
            .and_then(chrono::DateTime::from_timestamp_millis)
        {
            Some(t) => write!(f, "{}", t.format("%Y-%m-%dT%H:%M:%S%.3fZ")),
            None => write!(f, "{} ms after the Unix epoch", self.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: u64 = 1_000;

    #[test]
    fn a_token_admits_exactly_one_member() {
        let mut tokens = JoinTokens::default();
        let hash = "ab".repeat(32);
        assert!(tokens.put("not-a-hash", 1, TTL).is_err());
        tokens.put(&hash, 1, TTL).unwrap();
        assert!(
            tokens.consume(&"cd".repeat(32), 2, 2).is_err(),
            "unknown token"
        );
        tokens.consume(&hash, 2, 2).unwrap();
        assert!(tokens.consume(&hash, 3, 2).is_err(), "spent token");
        tokens.put(&"ef".repeat(32), 1, TTL).unwrap();
        assert_eq!(
            tokens.consume(&"ef".repeat(32), 2, 2),
            Err(Rejection::MemberExists(2))
        );
        assert!(tokens.admitted(2));
    }

    #[test]
    fn a_token_admits_until_its_ttl_runs_out_and_an_expired_one_stays_unspent() {
        let mut tokens = JoinTokens::default();
        let hash = "ab".repeat(32);
        tokens.put(&hash, 5_000, TTL).unwrap();
        assert_eq!(tokens.tokens()[&hash].expires_ms, 6_000);
        assert!(!tokens.tokens()[&hash].expired(5_999));
        // At the expiry itself the token no longer admits anyone.
        assert_eq!(
            tokens.consume(&hash, 2, 6_000),
            Err(Rejection::JoinTokenExpired {
                expired_ms: 6_000,
                now_ms: 6_000
            })
        );
        assert_eq!(tokens.tokens()[&hash].consumed_by, None);
        assert!(!tokens.admitted(2));
        assert!(tokens.tokens()[&hash].expired(6_000));
        // A live token still admits, just before its expiry.
        let live = "cd".repeat(32);
        tokens.put(&live, 5_000, TTL).unwrap();
        tokens.consume(&live, 2, 5_999).unwrap();
        assert_eq!(tokens.tokens()[&live].consumed_by, Some(2));
        // A TTL that would overflow the clock saturates instead of wrapping into the past.
        let forever = "ef".repeat(32);
        tokens.put(&forever, 5_000, u64::MAX).unwrap();
        tokens.consume(&forever, 3, u64::MAX - 1).unwrap();
    }

    #[test]
    fn times_show_as_utc() {
        let shown = |ms| UnixMillis(ms).to_string();
        assert_eq!(shown(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(shown(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(shown(1_796_300_656_123), "2026-12-03T12:24:16.123Z");
        assert_eq!(shown(4_102_444_799_999), "2099-12-31T23:59:59.999Z");
    }

    #[test]
    fn a_token_stored_before_expiry_existed_reads_as_expired() {
        let old: JoinToken = serde_json::from_str(r#"{"issued_ms":1,"consumed_by":null}"#).unwrap();
        assert_eq!(old.expires_ms, 0);
        assert!(old.expired(0));
    }
}
