//! What the dashboard shows of a cluster: each node as this router sees it, and the topology
//! group's members as the watcher last saw them.

use std::sync::PoisonError;
use std::sync::atomic::Ordering;

use serde::Serialize;
use strata_engine_api::load::EngineLoad;
use strata_topology::state::{ClusterState, Health, RaftRole};

use super::Cluster;

/// A node behind this router.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeView {
    pub addr: String,
    /// Connected now.
    pub alive: bool,
    /// Requests routed to it so far.
    pub routed: u64,
    /// Its last load report (`None` before the first).
    pub load: Option<EngineLoad>,
}

/// A member of the topology group.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemberView {
    pub id: u64,
    pub raft: String,
    pub rpc: String,
    /// `alive`, `suspect` or `down`.
    pub health: &'static str,
    /// `voter` or `learner`.
    pub role: &'static str,
    pub gpus: usize,
    pub gpu_memory_mib: u64,
    /// The tensor-parallel groups placed on it for this router's model: each group's GPU
    /// indices.
    pub tp_groups: Vec<Vec<u32>>,
}

impl MemberView {
    /// Every member of `state`, with the groups `model` has placed on each.
    pub fn of(state: &ClusterState, model: &str) -> Vec<Self> {
        let placed = state.placements().get(model);
        state
            .members()
            .values()
            .map(|m| Self {
                id: m.spec.id,
                raft: m.spec.addresses.raft.clone(),
                rpc: m.spec.addresses.rpc.clone(),
                health: match m.lease.health {
                    Health::Alive => "alive",
                    Health::Suspect => "suspect",
                    Health::Down => "down",
                },
                role: match m.spec.role {
                    RaftRole::Voter => "voter",
                    RaftRole::Learner => "learner",
                },
                gpus: m.spec.gpus.len(),
                gpu_memory_mib: m.spec.gpus.iter().map(|g| g.memory_mib).sum(),
                tp_groups: placed
                    .map(|p| {
                        p.groups
                            .iter()
                            .filter(|g| g.node == m.spec.id)
                            .map(|g| g.gpus.clone())
                            .collect()
                    })
                    .unwrap_or_default(),
            })
            .collect()
    }
}

impl Cluster {
    /// Every node, in the order they were added.
    pub fn node_views(&self) -> Vec<NodeView> {
        self.nodes()
            .iter()
            .map(|n| NodeView {
                addr: n.addr.to_string(),
                alive: n.alive(),
                routed: n.routed.load(Ordering::Relaxed),
                load: *n.report.lock().unwrap_or_else(PoisonError::into_inner),
            })
            .collect()
    }

    /// The ownership ring's epoch as the topology group last announced it (0 without one).
    pub fn ring_epoch(&self) -> u64 {
        self.ring_epoch.load(Ordering::Relaxed)
    }

    /// Records the topology group's members (the watcher, after each change).
    pub fn set_members(&self, members: Vec<MemberView>) {
        *self.members.write().unwrap_or_else(PoisonError::into_inner) = members;
    }

    /// The members as last recorded; empty for a router given its nodes by address.
    pub fn members(&self) -> Vec<MemberView> {
        self.members
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}
