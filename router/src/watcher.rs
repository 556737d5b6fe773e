//! The router's view of the topology group (DESIGN.md §6): which members serve requests, and
//! the ownership ring's epoch. A member serves once its node has declared a node RPC address of
//! its own (`strata node serve --data` does, through `UpdateMember`); until then its `rpc`
//! address is its raft address. A member whose lease is down serves no more.
//!
//! The watcher keeps a replica of the group's state from a subscription (the applied state, then
//! every committed command applied in order) and, after each change, makes the cluster's node set
//! equal to the serving members. Every router applies the same commands in the same order, so all
//! of them see the same nodes at the same ring epoch.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use strata_topology::state::{ClusterState, Health};
use strata_topology::transport::Client;
use strata_topology::transport::wire::FeedItem;

use crate::cluster::Cluster;

/// How long to wait before subscribing again after the feed ended.
const RESUBSCRIBE: Duration = Duration::from_millis(500);

/// The RPC addresses of the members that serve requests in `state`, by member id.
pub fn serving_nodes(state: &ClusterState) -> Vec<SocketAddr> {
    state
        .members()
        .values()
        .filter(|m| m.spec.addresses.rpc != m.spec.addresses.raft)
        .filter(|m| m.lease.health != Health::Down)
        .filter_map(|m| m.spec.addresses.rpc.parse().ok())
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

/// Keeps `cluster`'s nodes equal to the group's serving members while the process lives.
pub async fn follow(cluster: Arc<Cluster>, client: Client, seeds: Vec<String>) {
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
                    sync(&cluster, s);
                }
            }
            tracing::debug!("topology feed from {seed} ended; subscribing again");
        }
        tokio::time::sleep(RESUBSCRIBE).await;
    }
}

/// Adds the serving members the cluster lacks, removes the ones no longer serving, and records
/// the ring epoch.
pub fn sync(cluster: &Arc<Cluster>, state: &ClusterState) {
    let want = serving_nodes(state);
    for addr in cluster.node_addrs() {
        if !want.contains(&addr) {
            cluster.remove_node(addr);
        }
    }
    for addr in want {
        if let Err(e) = cluster.add_node(addr) {
            tracing::error!("node {addr}: {e}");
        }
    }
    cluster.set_ring_epoch(state.ring().epoch());
}
