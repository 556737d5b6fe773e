//! Join tokens: the hashes of one-use secrets that admit a new member.
//!
//! `cluster init` commits a token's SHA-256 (never the secret). A joiner presents the secret
//! to the member holding the CA key, which commits `ConsumeJoinToken` with the member id it
//! assigns before it signs anything: the token is spent in the log, so two joiners can never
//! both use it, and a replayed join is refused on every replica alike.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::Rejection;
use super::members::NodeId;

/// One token, by hash.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JoinToken {
    pub issued_ms: u64,
    /// The member admitted with it, once spent.
    pub consumed_by: Option<NodeId>,
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

    pub fn put(&mut self, sha256: &str, now_ms: u64) -> Result<(), Rejection> {
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
                consumed_by: None,
            },
        );
        Ok(())
    }

    /// Spends a token for member `id`. Refused for an unknown or spent token, or an id some
    /// token already admitted.
    pub fn consume(&mut self, sha256: &str, id: NodeId) -> Result<(), Rejection> {
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
        token.consumed_by = Some(id);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_admits_exactly_one_member() {
        let mut tokens = JoinTokens::default();
        let hash = "ab".repeat(32);
        assert!(tokens.put("not-a-hash", 1).is_err());
        tokens.put(&hash, 1).unwrap();
        assert!(
            tokens.consume(&"cd".repeat(32), 2).is_err(),
            "unknown token"
        );
        tokens.consume(&hash, 2).unwrap();
        assert!(tokens.consume(&hash, 3).is_err(), "spent token");
        tokens.put(&"ef".repeat(32), 1).unwrap();
        assert_eq!(
            tokens.consume(&"ef".repeat(32), 2),
            Err(Rejection::MemberExists(2))
        );
        assert!(tokens.admitted(2));
    }
}
