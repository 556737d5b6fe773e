//! Each node's supervisor: dials it (checking the model it serves), follows its KV events into
//! the prefix index and its load reports while the connection lasts, forgets its cache when the
//! connection ends, and redials with backoff.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use strata_engine_api::rpc::{KvFeed, NodeClient, NodeInfo};
use strata_model::ModelConfig;

use super::{Cluster, ClusterError, MeasuredRates, Node, NodeLoad};

/// How often each node's load is asked for.
const LOAD_INTERVAL: Duration = Duration::from_millis(50);
/// How long a node's KV feed waits before resubscribing after an error.
const FEED_RETRY: Duration = Duration::from_millis(200);
/// Redialing an unreachable node backs off from this to `REDIAL_MAX`.
const REDIAL_MIN: Duration = Duration::from_millis(100);
const REDIAL_MAX: Duration = Duration::from_secs(2);

/// Dials `addr` and checks the model it serves against `config`.
pub(super) async fn dial(
    endpoint: &quinn::Endpoint,
    addr: SocketAddr,
    server_name: &str,
    config: &ModelConfig,
) -> Result<(NodeClient, NodeInfo), ClusterError> {
    let client = NodeClient::connect(endpoint, addr, server_name).await?;
    let info = client.info().await?;
    let expected = config.architecture.model_type();
    if info.model_type != expected
        || info.vocab_size != config.vocab_size
        || info.max_position_embeddings != config.max_position_embeddings
    {
        return Err(ClusterError::Mismatch {
            addr,
            expected: format!(
                "{expected} (vocabulary {}, window {})",
                config.vocab_size, config.max_position_embeddings
            ),
            found: format!(
                "{} (vocabulary {}, window {})",
                info.model_type, info.vocab_size, info.max_position_embeddings
            ),
        });
    }
    Ok((client, info))
}

/// Keeps one node connected while the cluster lives: follows its KV events and load while the
/// connection lasts, forgets its cache when it ends, and redials.
pub(super) struct Supervisor {
    cluster: std::sync::Weak<Cluster>,
    node: Arc<Node>,
    endpoint: quinn::Endpoint,
    server_name: String,
}

impl Supervisor {
    /// `node`'s supervisor, holding `cluster` weakly (it ends with the cluster).
    pub(super) fn new(cluster: &Arc<Cluster>, node: Arc<Node>) -> Self {
        Self {
            cluster: Arc::downgrade(cluster),
            node,
            endpoint: cluster.endpoint.clone(),
            server_name: cluster.server_name.clone(),
        }
    }

    pub(super) async fn run(self) {
        let mut backoff = REDIAL_MIN;
        loop {
            let Some(cluster) = self.cluster.upgrade() else {
                return;
            };
            if self.node.removed.load(Ordering::Relaxed) {
                return;
            }
            let client = match self.node.client() {
                Some(client) => Some(client),
                None => self.redial(&cluster).await,
            };
            if let Some(client) = client {
                backoff = REDIAL_MIN;
                drop(cluster);
                self.follow(&client).await;
                self.node.set_client(None);
                if let Some(cluster) = self.cluster.upgrade() {
                    let mut index = cluster
                        .index
                        .write()
                        .unwrap_or_else(PoisonError::into_inner);
                    let _ = index.clear_node(self.node.slot);
                }
                tracing::warn!("node {} is gone; redialing", self.node.addr);
            } else {
                drop(cluster);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(REDIAL_MAX);
            }
        }
    }

    /// A new connection to the node, checked, or `None`.
    async fn redial(&self, cluster: &Cluster) -> Option<NodeClient> {
        let dialed = dial(
            &self.endpoint,
            self.node.addr,
            &self.server_name,
            &cluster.config,
        )
        .await;
        match dialed {
            Ok((client, info)) if info.block_size == cluster.block_size => {
                cluster
                    .device_blocks
                    .fetch_min(info.capacity_blocks, Ordering::Relaxed);
                self.node.set_info(&info);
                self.node.set_client(Some(client.clone()));
                tracing::info!("node {} connected", self.node.addr);
                Some(client)
            }
            Ok((_, info)) => {
                tracing::error!(
                    "node {} uses blocks of {} tokens, the cluster {}: not used",
                    self.node.addr,
                    info.block_size,
                    cluster.block_size
                );
                None
            }
            Err(e) => {
                tracing::debug!("{e}");
                None
            }
        }
    }

    /// Follows the node's KV events and load until its connection ends.
    async fn follow(&self, client: &NodeClient) {
        let kv = async {
            loop {
                if let Err(e) = self.follow_kv_once(client).await {
                    tracing::debug!("KV feed of node {}: {e}", self.node.addr);
                }
                tokio::time::sleep(FEED_RETRY).await;
            }
        };
        let load = async {
            let mut tick = tokio::time::interval(LOAD_INTERVAL);
            loop {
                tick.tick().await;
                if self.node.removed.load(Ordering::Relaxed) {
                    return;
                }
                if let Ok(load) = client.load().await {
                    *self
                        .node
                        .report
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner) = Some(load);
                    *self
                        .node
                        .load
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner) = NodeLoad {
                        queued_prefill_tokens: load.queued_prefill_tokens,
                        active_blocks: load.active_blocks,
                        capacity_blocks: load.capacity_blocks,
                    };
                    *self
                        .node
                        .rates
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner) = MeasuredRates {
                        tokens_per_s: load.tokens_per_s,
                        fetch_bytes_per_s: load.fetch_bytes_per_s,
                    };
                }
            }
        };
        tokio::select! {
            () = kv => {}
            () = load => {}
            () = client.closed() => {}
        }
    }

    /// Subscribe, then dump, then apply events; a gap, a lag or an error returns.
    async fn follow_kv_once(&self, client: &NodeClient) -> Result<(), String> {
        let Some(cluster) = self.cluster.upgrade() else {
            return Ok(());
        };
        let index = Arc::clone(&cluster.index);
        drop(cluster);
        let slot = self.node.slot;
        let mut feed = client.kv_events().await.map_err(|e| e.to_string())?;
        let dump = client.kv_dump().await.map_err(|e| e.to_string())?;
        index
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .load_dump(slot, &dump)
            .map_err(|e| e.to_string())?;
        loop {
            match feed.next().await.map_err(|e| e.to_string())? {
                Some(KvFeed::Event(event)) => index
                    .write()
                    .unwrap_or_else(PoisonError::into_inner)
                    .apply(slot, &event)
                    .map_err(|e| e.to_string())?,
                Some(KvFeed::Lagged { missed }) => {
                    return Err(format!("fell {missed} events behind"));
                }
                None => return Err("the node ended its feed".into()),
            }
        }
    }
}
