//! Join tokens: the hashes of one-use secrets that admit a new member.
//!
//! `cluster init` commits a token's SHA-256 (never the secret). A joiner presents the secret
//! to the member holding the CA key, which commits `ConsumeJoinToken` with the member id it
//! assigns before it signs anything: the token is spent in the log, so two joiners can never
//! both use it, and a replayed join is refused on every replica alike.
//!
//! A joiner that did not get its answer (a timeout, a leader change) presents the same token
//! again with the same key: the token records the SHA-256 of the public key it admitted, and
//! the same key gets the same member id back while the token lives and that member has not
//! recorded itself yet. Any other key is refused, so a spent token admits one joiner only.
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
    /// The SHA-256 of the public key it admitted (absent in tokens spent before it was kept).
    #[serde(default)]
    pub key_sha256: Option<String>,
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

    /// The member a spent token admitted for the key with this SHA-256, while the token lives.
    pub fn readmits(&self, sha256: &str, key_sha256: &str, now_ms: u64) -> Option<NodeId> {
        let token = self.by_sha256.get(sha256)?;
        (token.key_sha256.as_deref() == Some(key_sha256) && !token.expired(now_ms))
            .then_some(token.consumed_by)
            .flatten()
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
                key_sha256: None,
            },
        );
        Ok(())
    }

    /// Spends a token for member `id` with the public key `key_sha256` at group time `now_ms`.
    /// Refused, spending nothing, for an unknown or expired token, a token spent for another
    /// key or id, or an id another token admitted. The same key and id again is no change.
    pub fn consume(
        &mut self,
        sha256: &str,
        id: NodeId,
        key_sha256: Option<&str>,
        now_ms: u64,
    ) -> Result<(), Rejection> {
        let admitted_elsewhere = self
            .by_sha256
            .iter()
            .any(|(hash, t)| hash != sha256 && t.consumed_by == Some(id));
        let token = self
            .by_sha256
            .get_mut(sha256)
            .ok_or_else(|| Rejection::NotFound("join token".into()))?;
        if token.expired(now_ms) {
            return Err(Rejection::JoinTokenExpired {
                expired_ms: token.expires_ms,
                now_ms,
            });
        }
        if let Some(by) = token.consumed_by {
            let same_joiner = key_sha256.is_some() && token.key_sha256.as_deref() == key_sha256;
            if same_joiner && by == id {
                return Ok(());
            }
            return Err(Rejection::AlreadyExists(
                "a member admitted with this join token".into(),
            ));
        }
        if admitted_elsewhere {
            return Err(Rejection::MemberExists(id));
        }
        token.consumed_by = Some(id);
        token.key_sha256 = key_sha256.map(str::to_string);
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
            tokens.consume(&"cd".repeat(32), 2, None, 2).is_err(),
            "unknown token"
        );
        tokens.consume(&hash, 2, None, 2).unwrap();
        assert!(tokens.consume(&hash, 3, None, 2).is_err(), "spent token");
        assert!(
            tokens.consume(&hash, 2, None, 2).is_err(),
            "spent, no key to match"
        );
        tokens.put(&"ef".repeat(32), 1, TTL).unwrap();
        assert_eq!(
            tokens.consume(&"ef".repeat(32), 2, None, 2),
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
            tokens.consume(&hash, 2, None, 6_000),
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
        tokens.consume(&live, 2, None, 5_999).unwrap();
        assert_eq!(tokens.tokens()[&live].consumed_by, Some(2));
        // A TTL that would overflow the clock saturates instead of wrapping into the past.
        let forever = "ef".repeat(32);
        tokens.put(&forever, 5_000, u64::MAX).unwrap();
        tokens.consume(&forever, 3, None, u64::MAX - 1).unwrap();
    }

    #[test]
    fn the_same_key_is_readmitted_with_the_same_id_and_no_other_key_is() {
        let mut tokens = JoinTokens::default();
        let hash = "ab".repeat(32);
        let (key, other) = ("11".repeat(32), "22".repeat(32));
        tokens.put(&hash, 1_000, TTL).unwrap();
        tokens.consume(&hash, 4, Some(&key), 1_100).unwrap();
        assert_eq!(tokens.readmits(&hash, &key, 1_200), Some(4));
        // The answer was lost: the same joiner asks again, nothing changes.
        tokens.consume(&hash, 4, Some(&key), 1_200).unwrap();
        assert_eq!(tokens.tokens()[&hash].consumed_by, Some(4));
        // Canaries: another key, another id, or the same key after the TTL are refused.
        assert_eq!(tokens.readmits(&hash, &other, 1_200), None);
        assert!(tokens.consume(&hash, 5, Some(&other), 1_200).is_err());
        assert!(tokens.consume(&hash, 5, Some(&key), 1_200).is_err());
        assert!(tokens.consume(&hash, 4, None, 1_200).is_err());
        assert_eq!(tokens.readmits(&hash, &key, 2_000), None);
        assert!(tokens.consume(&hash, 4, Some(&key), 2_000).is_err());
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
