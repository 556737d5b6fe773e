//! Request routing across nodes: the exact prefix index fed by each node's KV events, and the
//! policy that scores nodes by cached prefix and load (DESIGN.md §6).

mod fetch;
mod index;
mod policy;
#[cfg(test)]
mod tests;

pub use fetch::{KvFetchConfig, MeasuredRates};
pub use index::{IndexError, MAX_NODES, Overlap, PrefixIndex, Slot};
pub use policy::{
    Candidate, Decision, NodeLoad, Policy, Reason, Router, RoutingConfig, VNODES_PER_GPU,
};

use serde::{Deserialize, Serialize};

/// The router's tuning file (`strata router --routing-config`, TOML): the cache-aware policy's
/// parameters and the cross-node KV fetch cost model. Every key is optional.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RoutingSettings {
    pub cache_aware: RoutingConfig,
    pub kv_fetch: KvFetchConfig,
}

impl RoutingSettings {
    pub fn from_toml(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }
}
