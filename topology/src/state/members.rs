//! Cluster members: what each node told the group about itself when it joined.
//!
//! A member is a serving node (or a pure raft voter) with its addresses, GPUs, capacity and
//! labels. Its raft role is recorded here so that every reader sees the intended shape of the
//! group; the raft membership itself is changed through openraft, not by this record.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::Rejection;
use super::health::Lease;

/// A member's id; the same id is its raft node id.
pub type NodeId = u64;

/// The most GPUs one member may declare. Larger numbers are input errors, not hardware.
pub const MAX_GPUS_PER_MEMBER: usize = 64;

/// One GPU of a member.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    /// Device index on the node (CUDA ordinal).
    pub index: u32,
    pub memory_mib: u64,
    /// GPUs sharing a link group have a fast direct interconnect (an NVLink pair or island);
    /// tensor-parallel groups prefer to stay inside one.
    pub link_group: u32,
}

/// How the member takes part in raft.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RaftRole {
    Voter,
    Learner,
}

/// Where to reach a member.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberAddresses {
    /// The topology (raft) endpoint, `host:port`.
    pub raft: String,
    /// The node's serving RPC endpoint, `host:port`.
    pub rpc: String,
}

/// Serving capacity a router normalises load against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Capacity {
    /// KV cache blocks across the member's tiers on device.
    pub kv_blocks: u64,
    /// Sequences the member runs at once.
    pub max_sequences: u32,
}

/// What a node declares when it joins.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberSpec {
    pub id: NodeId,
    pub addresses: MemberAddresses,
    pub gpus: Vec<Gpu>,
    pub capacity: Capacity,
    pub labels: BTreeMap<String, String>,
    pub role: RaftRole,
}

impl MemberSpec {
    /// Refuses specs no node could have sent: empty addresses, duplicate GPU indices, empty
    /// label keys, absurd GPU counts.
    pub fn validate(&self) -> Result<(), Rejection> {
        let bad = |why: String| Err(Rejection::InvalidMember { id: self.id, why });
        if self.addresses.raft.trim().is_empty() || self.addresses.rpc.trim().is_empty() {
            return bad("both the raft and rpc addresses are required".into());
        }
        if self.gpus.len() > MAX_GPUS_PER_MEMBER {
            return bad(format!(
                "{} GPUs declared; at most {MAX_GPUS_PER_MEMBER}",
                self.gpus.len()
            ));
        }
        let mut seen = std::collections::BTreeSet::new();
        for gpu in &self.gpus {
            if !seen.insert(gpu.index) {
                return bad(format!("GPU index {} declared twice", gpu.index));
            }
        }
        if self.labels.keys().any(|k| k.trim().is_empty()) {
            return bad("label keys must be non-empty".into());
        }
        Ok(())
    }

    /// Whether every required label is present with the required value.
    pub fn has_labels(&self, required: &BTreeMap<String, String>) -> bool {
        required
            .iter()
            .all(|(k, v)| self.labels.get(k).is_some_and(|have| have == v))
    }
}

/// A member as the group knows it: its declaration and its health lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub spec: MemberSpec,
    pub lease: Lease,
}

#[cfg(test)]
pub(crate) fn test_spec(id: NodeId, gpus: &[(u32, u32)]) -> MemberSpec {
    MemberSpec {
        id,
        addresses: MemberAddresses {
            raft: format!("127.0.0.1:{}", 7000 + id),
            rpc: format!("127.0.0.1:{}", 8000 + id),
        },
        gpus: gpus
            .iter()
            .map(|&(index, link_group)| Gpu {
                index,
                memory_mib: 80 * 1024,
                link_group,
            })
            .collect(),
        capacity: Capacity {
            kv_blocks: 10_000,
            max_sequences: 64,
        },
        labels: BTreeMap::new(),
        role: RaftRole::Voter,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validate_refuses_duplicate_gpu_and_empty_address() {
        let mut spec = test_spec(1, &[(0, 0), (1, 0)]);
        assert!(spec.validate().is_ok());
        spec.gpus.push(Gpu {
            index: 1,
            memory_mib: 1,
            link_group: 0,
        });
        assert!(matches!(
            spec.validate(),
            Err(Rejection::InvalidMember { id: 1, .. })
        ));
        let mut spec = test_spec(2, &[]);
        spec.addresses.rpc = " ".into();
        assert!(spec.validate().is_err());
    }

    #[test]
    fn labels_must_all_match() {
        let mut spec = test_spec(1, &[]);
        spec.labels.insert("zone".into(), "a".into());
        spec.labels.insert("gpu".into(), "h200".into());
        let mut want = BTreeMap::new();
        want.insert("zone".to_string(), "a".to_string());
        assert!(spec.has_labels(&want));
        want.insert("gpu".to_string(), "b200".to_string());
        assert!(!spec.has_labels(&want));
    }
}
