//! Router registrations: which routers follow the group, and where they serve. Routers are
//! not raft members; registering makes them visible to operators and to each other.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::Rejection;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouterRegistration {
    pub id: String,
    /// The router's public HTTP address, `host:port`.
    pub http_addr: String,
    pub registered_ms: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouterRegistry {
    routers: BTreeMap<String, RouterRegistration>,
}

impl RouterRegistry {
    pub fn routers(&self) -> &BTreeMap<String, RouterRegistration> {
        &self.routers
    }

    /// Registers a router, or updates the address of one already registered (a restarted
    /// router keeps its id).
    pub fn register(&mut self, id: &str, http_addr: &str, now_ms: u64) -> Result<(), Rejection> {
        if id.is_empty() || !id.chars().all(|c| c.is_ascii_graphic()) {
            return Err(Rejection::InvalidName(id.to_string()));
        }
        if http_addr.trim().is_empty() {
            return Err(Rejection::InvalidName(format!(
                "router `{id}` address is empty"
            )));
        }
        let entry = self
            .routers
            .entry(id.to_string())
            .or_insert(RouterRegistration {
                id: id.to_string(),
                http_addr: String::new(),
                registered_ms: now_ms,
            });
        entry.http_addr = http_addr.to_string();
        Ok(())
    }

    pub fn deregister(&mut self, id: &str) -> Result<(), Rejection> {
        match self.routers.remove(id) {
            Some(_) => Ok(()),
            None => Err(Rejection::NotFound(format!("router `{id}`"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reregistering_keeps_first_time_and_updates_address() {
        let mut r = RouterRegistry::default();
        r.register("r1", "10.0.0.1:8080", 5).unwrap();
        r.register("r1", "10.0.0.2:8080", 9).unwrap();
        let reg = &r.routers()["r1"];
        assert_eq!(
            (reg.http_addr.as_str(), reg.registered_ms),
            ("10.0.0.2:8080", 5)
        );
        assert!(r.register("", "x:1", 1).is_err());
        assert!(r.register("r2", " ", 1).is_err());
        assert!(r.deregister("r1").is_ok());
        assert!(matches!(r.deregister("r1"), Err(Rejection::NotFound(_))));
    }
}
