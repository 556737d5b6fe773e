//! The router's view of the topology group (DESIGN.md §6): which members serve requests, where
//! each sits on the ownership ring, and the ring's epoch. A member serves once its node has
//! declared a node RPC address of its own (`strata node serve --data` does, through
//! `UpdateMember`); until then its `rpc` address is its raft address. A member whose lease is
//! down serves no more. When the group has a placement for the router's model, only the
//! members hosting one of its groups serve it; a model without a placement is served by every
//! serving member (each node's model is checked when it is dialed).
//!
//! The watcher keeps a replica of the group's state from a subscription (the applied state, then
//! every committed command applied in order) and, after each change, makes the cluster's node set
//! equal to the serving members. Every router applies the same commands in the same order, so all
//! of them see the same nodes at the same ring epoch.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use strata_topology::ring::VNODES_PER_GPU;
use strata_topology::state::{ClusterState, Health};
use strata_topology::transport::Client;
use strata_topology::transport::wire::FeedItem;

use crate::cluster::{Cluster, RingMember};

/// How long to wait before subscribing again after the feed ended.
const RESUBSCRIBE: Duration = Duration::from_millis(500);

/// A member serving requests: its node's RPC address and its place on the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServingNode {
    pub addr: SocketAddr,
    pub ring: RingMember,
}

/// The members that serve `model` in `state`, by member id.
pub fn serving_nodes(state: &ClusterState, model: &str) -> Vec<ServingNode> {
    let placed = state.placements().get(model);
    state
        .members()
        .values()
        .filter(|m| m.spec.addresses.rpc != m.spec.addresses.raft)
        .filter(|m| m.lease.health != Health::Down)
        .filter(|m| placed.is_none_or(|p| p.groups.iter().any(|g| g.node == m.spec.id)))
        .filter_map(|m| {
            let addr = m.spec.addresses.rpc.parse().ok()?;
            // The ring's own count for a live member; the same rule for one it does not list.
            let vnodes = state.ring().members().get(&m.spec.id).copied();
            let gpus = u32::try_from(m.spec.gpus.len()).unwrap_or(u32::MAX).max(1);
            let ring = RingMember {
                id: m.spec.id,
                vnodes: vnodes.unwrap_or(gpus.saturating_mul(VNODES_PER_GPU)),
            };
            Some(ServingNode { addr, ring })
        })
        .collect()
}

/// The group's state, read (linearizably) through the first of `seeds` that answers.
pub async fn read_state(client: &Client, seeds: &[String]) -> Result<ClusterState, String> {
    let mut errors = Vec::new();
    for seed in seeds {
        match client.read(seed).await {
            Ok(view) => return Ok(view.cluster),
            Err(e) => errors.push(e.to_string()),
        }
    }
    Err(errors.join("; "))
}

/// Keeps `cluster`'s nodes equal to the group's members serving `model` while the process
/// lives.
pub async fn follow(cluster: Arc<Cluster>, client: Client, seeds: Vec<String>, model: String) {
    loop {
        for seed in &seeds {
            let Ok(mut feed) = client.subscribe(seed).await else {
                continue;
            };
            let mut state: Option<ClusterState> = None;
            loop {
                match feed.next().await {
                    Ok(Some(FeedItem::Start { cluster: s, .. })) => state = Some(s),
                    Ok(Some(FeedItem::Applied {
                        command: Some(command),
                        ..
                    })) => {
                        if let Some(s) = state.as_mut() {
                            // A rejected command leaves the state as it was, on every member
                            // and here alike.
                            let _ = s.apply(&command);
                        }
                    }
                    Ok(Some(FeedItem::Applied { command: None, .. })) => continue,
                    Ok(Some(FeedItem::Restart) | None) | Err(_) => break,
                }
                if let Some(s) = &state {
                    sync(&cluster, s, &model);
                }
            }
            tracing::debug!("topology feed from {seed} ended; subscribing again");
        }
        tokio::time::sleep(RESUBSCRIBE).await;
    }
}

/// Adds the members serving `model` the cluster lacks (or updates their ring places), removes
/// the ones no longer serving it, and records the ring epoch.
pub fn sync(cluster: &Arc<Cluster>, state: &ClusterState, model: &str) {
    let want = serving_nodes(state, model);
    for addr in cluster.node_addrs() {
        if !want.iter().any(|n| n.addr == addr) {
            cluster.remove_node(addr);
        }
    }
    for node in want {
        if let Err(e) = cluster.add_node(node.addr, node.ring) {
            tracing::error!("node {}: {e}", node.addr);
        }
    }
    cluster.set_ring_epoch(state.ring().epoch());
    cluster.set_members(crate::cluster::MemberView::of(state, model));
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use strata_topology::state::{
        Capacity, Change, Command, Gpu, MemberAddresses, MemberSpec, PlacementRequest, RaftRole,
    };

    use super::*;

    fn member(id: u64, gpus: u32, serving: bool) -> MemberSpec {
        let raft = format!("127.0.0.1:{}", 7000 + id);
        MemberSpec {
            id,
            addresses: MemberAddresses {
                rpc: if serving {
                    format!("127.0.0.1:{}", 8000 + id)
                } else {
                    raft.clone()
                },
                raft,
            },
            gpus: (0..gpus)
                .map(|index| Gpu {
                    index,
                    memory_mib: 80 * 1024,
                    link_group: 0,
                })
                .collect(),
            capacity: Capacity::default(),
            labels: BTreeMap::new(),
            role: RaftRole::Voter,
        }
    }

    #[test]
    fn serving_nodes_follow_rpc_addresses_placement_and_the_ring() {
        let mut state = ClusterState::default();
        for spec in [member(1, 1, true), member(2, 2, true), member(3, 1, false)] {
            state
                .apply(&Command::new(1, Change::AddMember(spec)))
                .unwrap();
        }
        let addrs = |nodes: Vec<ServingNode>| -> Vec<(u16, u64, u32)> {
            nodes
                .iter()
                .map(|n| (n.addr.port(), n.ring.id, n.ring.vnodes))
                .collect()
        };
        // Member 3 has not declared a node: it does not serve. Virtual nodes: 8 per GPU.
        assert_eq!(
            addrs(serving_nodes(&state, "m")),
            vec![(8001, 1, 8), (8002, 2, 16)]
        );
        // Placed on member 2 alone, model `m` is served there only; other models everywhere.
        let place = PlacementRequest {
            model: "m".into(),
            tp_size: 2,
            replicas: 1,
            min_gpu_memory_mib: 0,
            required_labels: BTreeMap::new(),
            experts: 0,
        };
        state
            .apply(&Command::new(2, Change::PlaceModel(place)))
            .unwrap();
        assert_eq!(addrs(serving_nodes(&state, "m")), vec![(8002, 2, 16)]);
        assert_eq!(serving_nodes(&state, "other").len(), 2);
    }
}
