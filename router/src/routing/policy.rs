//! Choosing a node for a request (DESIGN.md §6): cache-aware by default — credit for the prefix a
//! node already holds, minus its load — and, for a prefix no node holds, the prefix's owner on
//! the topology group's ownership ring (`strata_topology::ring`: the same scores, so every router
//! agrees with the group's ring at its epoch) with bounded load. Round-robin and least-loaded
//! exist for comparison.

use serde::{Deserialize, Serialize};
use strata_engine_api::kv::BlockHash;
pub use strata_topology::ring::VNODES_PER_GPU;
use strata_topology::ring::{key_hash, member_score};

use super::index::{MAX_NODES, PrefixIndex, Slot};

/// The cache-aware policy's parameters (router configuration).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RoutingConfig {
    /// Credit per cached prefix block on the device, host and disk tiers.
    pub credits: [f32; 3],
    /// Blocks of credit a fully loaded node loses per block of the request: at 1.0 a node
    /// holding the whole prefix but fully busy ties with an idle node holding none of it.
    pub load_weight: f32,
    /// Bounded load for ring placement: the owner is skipped while its load exceeds
    /// `(1 + epsilon) × mean load`, and the next node on the ring is tried.
    pub bounded_load_epsilon: f32,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            credits: [1.0, 0.75, 0.25],
            load_weight: 1.0,
            bounded_load_epsilon: 0.25,
        }
    }
}

/// How a router picks nodes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "policy", rename_all = "snake_case")]
pub enum Policy {
    CacheAware(RoutingConfig),
    RoundRobin,
    LeastLoaded,
}

impl Default for Policy {
    fn default() -> Self {
        Policy::CacheAware(RoutingConfig::default())
    }
}

/// A node's load as it last reported it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct NodeLoad {
    /// Prompt tokens admitted but not yet prefilled.
    pub queued_prefill_tokens: u64,
    /// KV blocks held by running sequences.
    pub active_blocks: u64,
    /// KV blocks the node has in all.
    pub capacity_blocks: u64,
}

impl NodeLoad {
    /// Demand over capacity, both in blocks (queued prompt tokens count as the blocks they will
    /// take); a node reporting no capacity is fully loaded.
    pub fn utilization(&self, block_size: usize) -> f32 {
        if self.capacity_blocks == 0 {
            return 1.0;
        }
        let queued = self
            .queued_prefill_tokens
            .div_ceil(block_size.max(1) as u64);
        (queued + self.active_blocks) as f32 / self.capacity_blocks as f32
    }
}

/// A node the router may send to.
#[derive(Debug, Clone, Copy)]
pub struct Candidate {
    pub slot: Slot,
    /// The node on the ownership ring: its member id and virtual node count, as the group's
    /// ring has them (a router given fixed addresses uses a hash of the address and
    /// [`VNODES_PER_GPU`]).
    pub ring_id: u64,
    pub vnodes: u32,
    pub load: NodeLoad,
}

/// Why a node was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// It held the best-scoring cached prefix.
    Cache,
    /// No node held the prefix: its ring owner, or the next one under the load bound.
    Ring,
    RoundRobin,
    LeastLoaded,
}

/// The node a request goes to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    pub slot: Slot,
    /// Leading blocks of the request already cached there.
    pub cached_blocks: u32,
    pub reason: Reason,
    /// The candidate holding the most leading blocks of the request (ties: the lower slot) and
    /// how many, when some candidate holds any: where a cross-node fetch would come from.
    pub holder: Option<(Slot, u32)>,
}

/// Picks nodes by a [`Policy`]. `route` takes `&mut self` only for the round-robin cursor.
#[derive(Debug, Clone, Default)]
pub struct Router {
    policy: Policy,
    next: usize,
}

impl Router {
    pub fn new(policy: Policy) -> Self {
        Self { policy, next: 0 }
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// The node for a request whose prompt has the block hashes `chain` (full blocks only) and
    /// whose ring key is `prefix_key` (its first block's hash, or a hash of its tokens when it
    /// is shorter than a block). `None` when there is no candidate. Ties go to the lower slot.
    pub fn route(
        &mut self,
        index: &PrefixIndex,
        nodes: &[Candidate],
        chain: &[BlockHash],
        prefix_key: u128,
        block_size: usize,
    ) -> Option<Decision> {
        if nodes.is_empty() {
            return None;
        }
        let credits = match &self.policy {
            Policy::CacheAware(config) => config.credits,
            _ => [1.0; 3],
        };
        let overlap = index.overlap(chain, credits);
        let decide = |slot: Slot, reason| Decision {
            slot,
            cached_blocks: overlap.blocks[slot.index()],
            reason,
            holder: None,
        };
        let mut decision = match &self.policy {
            Policy::RoundRobin => {
                let node = nodes[self.next % nodes.len()];
                self.next = self.next.wrapping_add(1);
                decide(node.slot, Reason::RoundRobin)
            }
            Policy::LeastLoaded => {
                decide(least_loaded(nodes, block_size).slot, Reason::LeastLoaded)
            }
            Policy::CacheAware(config) => {
                let request_blocks = chain.len().max(1) as f32;
                let mut best: Option<(f32, &Candidate)> = None;
                for node in nodes {
                    let credit = overlap.credit[node.slot.index()];
                    if credit <= 0.0 {
                        continue;
                    }
                    let score = credit
                        - config.load_weight * request_blocks * node.load.utilization(block_size);
                    if best.is_none_or(|(b, n)| score > b || (score == b && node.slot < n.slot)) {
                        best = Some((score, node));
                    }
                }
                // A cached prefix wins only if it beats sending the request where nothing is
                // cached and the load is lowest (score of that option: minus its load).
                let idle = least_loaded(nodes, block_size);
                let idle_score =
                    -config.load_weight * request_blocks * idle.load.utilization(block_size);
                match best {
                    Some((score, node)) if score >= idle_score => decide(node.slot, Reason::Cache),
                    Some(_) => decide(idle.slot, Reason::LeastLoaded),
                    None => decide(
                        ring_owner(nodes, prefix_key, config, block_size).slot,
                        Reason::Ring,
                    ),
                }
            }
        };
        decision.holder = nodes
            .iter()
            .map(|n| (n.slot, overlap.blocks[n.slot.index()]))
            .filter(|&(_, blocks)| blocks > 0)
            .max_by(|a, b| a.1.cmp(&b.1).then(b.0.cmp(&a.0)));
        Some(decision)
    }
}

fn least_loaded(nodes: &[Candidate], block_size: usize) -> Candidate {
    *nodes
        .iter()
        .min_by(|a, b| {
            a.load
                .utilization(block_size)
                .total_cmp(&b.load.utilization(block_size))
                .then(a.slot.cmp(&b.slot))
        })
        .expect("nodes is not empty")
}

/// The prefix's owner on the ownership ring (the key is the prefix key's little-endian
/// bytes), skipping owners above the load bound.
fn ring_owner(
    nodes: &[Candidate],
    prefix_key: u128,
    config: &RoutingConfig,
    block_size: usize,
) -> Candidate {
    let key = key_hash(&prefix_key.to_le_bytes());
    let mut ranked: Vec<(u64, &Candidate)> = nodes
        .iter()
        .map(|n| (member_score(key, n.ring_id, n.vnodes), n))
        .collect();
    // Highest score first; ties to the smaller id, as the group's ring breaks them.
    ranked.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.ring_id.cmp(&b.1.ring_id)));
    let mean = nodes
        .iter()
        .map(|n| n.load.utilization(block_size))
        .sum::<f32>()
        / nodes.len() as f32;
    let bound = (1.0 + config.bounded_load_epsilon) * mean;
    ranked
        .iter()
        .find(|(_, n)| n.load.utilization(block_size) <= bound)
        .map_or(*ranked[0].1, |(_, n)| **n)
}

const _: () = assert!(MAX_NODES <= 64, "node sets are u64 bitmaps");
