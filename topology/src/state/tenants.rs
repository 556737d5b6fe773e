//! The API-key and tenant registry. Only a key's SHA-256 is ever stored or replicated — the
//! key itself never enters the raft log — in the same form the router's keys file uses.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::Rejection;

/// A tenant: the unit of isolation (its own cache salt, its own keys).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tenant {
    pub name: String,
    pub created_ms: u64,
}

/// One API key, by hash.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ApiKey {
    /// Short public id (the router shows it in logs).
    pub id: String,
    pub tenant: String,
    /// Lowercase hex SHA-256 of the whole key.
    pub sha256: String,
    pub created_ms: u64,
}

/// Tenants and their keys.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TenantRegistry {
    tenants: BTreeMap<String, Tenant>,
    /// By key id.
    keys: BTreeMap<String, ApiKey>,
}

impl TenantRegistry {
    pub fn tenants(&self) -> &BTreeMap<String, Tenant> {
        &self.tenants
    }

    pub fn keys(&self) -> &BTreeMap<String, ApiKey> {
        &self.keys
    }

    /// The key with this hash, if any (what the router checks a presented key against).
    pub fn key_by_sha256(&self, sha256: &str) -> Option<&ApiKey> {
        self.keys.values().find(|k| k.sha256 == sha256)
    }

    pub fn put_tenant(&mut self, name: &str, now_ms: u64) -> Result<(), Rejection> {
        if !valid_name(name) {
            return Err(Rejection::InvalidName(name.to_string()));
        }
        if self.tenants.contains_key(name) {
            return Err(Rejection::AlreadyExists(format!("tenant `{name}`")));
        }
        self.tenants.insert(
            name.to_string(),
            Tenant {
                name: name.to_string(),
                created_ms: now_ms,
            },
        );
        Ok(())
    }

    /// Removes a tenant and revokes all of its keys; returns how many keys went.
    pub fn remove_tenant(&mut self, name: &str) -> Result<usize, Rejection> {
        if self.tenants.remove(name).is_none() {
            return Err(Rejection::NotFound(format!("tenant `{name}`")));
        }
        let before = self.keys.len();
        self.keys.retain(|_, k| k.tenant != name);
        Ok(before - self.keys.len())
    }

    pub fn put_key(
        &mut self,
        id: &str,
        tenant: &str,
        sha256: &str,
        now_ms: u64,
    ) -> Result<(), Rejection> {
        if !valid_name(id) {
            return Err(Rejection::InvalidName(id.to_string()));
        }
        if !is_lower_hex_sha256(sha256) {
            return Err(Rejection::InvalidKeyHash { id: id.to_string() });
        }
        if !self.tenants.contains_key(tenant) {
            return Err(Rejection::NotFound(format!("tenant `{tenant}`")));
        }
        if self.keys.contains_key(id) || self.key_by_sha256(sha256).is_some() {
            return Err(Rejection::AlreadyExists(format!("key `{id}`")));
        }
        self.keys.insert(
            id.to_string(),
            ApiKey {
                id: id.to_string(),
                tenant: tenant.to_string(),
                sha256: sha256.to_string(),
                created_ms: now_ms,
            },
        );
        Ok(())
    }

    pub fn revoke_key(&mut self, id: &str) -> Result<(), Rejection> {
        match self.keys.remove(id) {
            Some(_) => Ok(()),
            None => Err(Rejection::NotFound(format!("key `{id}`"))),
        }
    }
}

/// Printable, no spaces, at most 128 bytes: the router's rule for tenant names.
pub(super) fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 128 && name.chars().all(|c| c.is_ascii_graphic())
}

fn is_lower_hex_sha256(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    const HASH_A: &str = "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824";
    const HASH_B: &str = "486ea46224d1bb4fb680f34f7c9ad96a8f24ec88be73ea8e5a6c65260e9cb8a7";

    #[test]
    fn keys_need_a_tenant_and_a_real_hash() {
        let mut r = TenantRegistry::default();
        assert!(matches!(
            r.put_key("k1", "acme", HASH_A, 1),
            Err(Rejection::NotFound(_))
        ));
        r.put_tenant("acme", 1).unwrap();
        // A plaintext key in the hash field is refused, so it cannot reach the log by mistake.
        assert!(matches!(
            r.put_key("k1", "acme", "sk-strata-plaintext", 1),
            Err(Rejection::InvalidKeyHash { .. })
        ));
        assert!(matches!(
            r.put_key("k1", "acme", &HASH_A.to_uppercase(), 1),
            Err(Rejection::InvalidKeyHash { .. })
        ));
        r.put_key("k1", "acme", HASH_A, 2).unwrap();
        assert_eq!(r.key_by_sha256(HASH_A).unwrap().tenant, "acme");
        assert!(matches!(
            r.put_key("k2", "acme", HASH_A, 3),
            Err(Rejection::AlreadyExists(_))
        ));
        assert!(matches!(
            r.put_key("k1", "acme", HASH_B, 3),
            Err(Rejection::AlreadyExists(_))
        ));
    }

    #[test]
    fn removing_a_tenant_revokes_its_keys_only() {
        let mut r = TenantRegistry::default();
        r.put_tenant("acme", 1).unwrap();
        r.put_tenant("globex", 1).unwrap();
        r.put_key("k1", "acme", HASH_A, 1).unwrap();
        r.put_key("k2", "globex", HASH_B, 1).unwrap();
        assert_eq!(r.remove_tenant("acme"), Ok(1));
        assert!(r.key_by_sha256(HASH_A).is_none());
        assert!(r.key_by_sha256(HASH_B).is_some());
        assert!(r.remove_tenant("acme").is_err());
        assert!(r.revoke_key("k2").is_ok());
        assert!(r.revoke_key("k2").is_err());
        assert!(matches!(
            r.put_tenant("has space", 1),
            Err(Rejection::InvalidName(_))
        ));
    }
}
