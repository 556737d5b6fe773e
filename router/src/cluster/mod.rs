//! The router's view of its nodes (DESIGN.md §2, §6): a QUIC connection to each, the prefix
//! index fed by their KV events, their load, and the routing policy that picks one per request.
//!
//! A request is admitted here with the engine's own checks ([`Admission`]), routed, and relayed
//! from the node it went to. If that node fails mid-stream (its connection drops, it dies), the
//! request continues on another node from where it stood ([`Resume`]: the tokens already
//! emitted and the sampler's RNG position), so the client sees the same stream as without the
//! failure, sampled or greedy. A node whose connection has ended takes no more requests. The
//! failover budget is per attempt and time, not per node: an incarnation of a node that failed
//! the request is left out of its later attempts, but the node restarted (reconnected) may take
//! it again, and while no node can take it the request waits up to [`FAILOVER_WAIT`] for one —
//! unless no node is connected at all, when it ends at once as unavailable (a 503 with
//! Retry-After, as a new request is told); after [`FAILOVER_ATTEMPTS`] attempts the stream fails
//! with the reasons.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use strata_engine_api::kv::{BlockHash, KvLayout, block_hash, prompt_block_hashes};
use strata_engine_api::rpc::{
    KvFetch, NodeClient, NodeError, NodeInfo, PinReport, Refusal, RefusalKind,
};
use strata_engine_api::submit::{Admission, RequestStream, SubmitError};
use strata_model::ModelConfig;
use strata_model::grammar::GrammarCompiler;
use strata_protocol::GenerateRequest;
use tokio::sync::mpsc::unbounded_channel;
use tokio::sync::oneshot;

mod client;
mod metrics;
mod relay;
mod supervisor;
mod views;

pub use client::ClusterClient;
pub use views::{MemberView, NodeView};

use supervisor::{Supervisor, dial};

/// Attempts one request may make (its first included) before it fails.
pub const FAILOVER_ATTEMPTS: usize = 16;
/// How long a request whose every node failed it waits for one to come (back).
pub const FAILOVER_WAIT: Duration = Duration::from_secs(30);
/// How often that wait looks.
const FAILOVER_POLL: Duration = Duration::from_millis(100);
/// How long a request every node refused as busy waits before trying them again.
const BUSY_BACKOFF: Duration = Duration::from_millis(50);

use crate::routing::{
    Candidate, KvFetchConfig, MeasuredRates, NodeLoad, PrefixIndex, Reason, Router, Slot,
    VNODES_PER_GPU,
};

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("no nodes given")]
    NoNodes,
    #[error(transparent)]
    Node(#[from] NodeError),
    #[error("node {addr} serves {found}, this router's model is {expected}")]
    Mismatch {
        addr: SocketAddr,
        expected: String,
        found: String,
    },
    #[error("too many nodes: {0}")]
    Index(String),
}

struct Node {
    addr: SocketAddr,
    slot: Slot,
    /// Its member id and virtual nodes on the ownership ring.
    ring: Mutex<RingMember>,
    /// The live connection; `None` while the node is unreachable (the supervisor redials it).
    client: RwLock<Option<NodeClient>>,
    /// Its KV layout as it last said: blocks move only between nodes with equal layouts.
    kv_layout: RwLock<Option<KvLayout>>,
    load: Mutex<NodeLoad>,
    /// Its compute and fetch rates as it last reported them.
    rates: Mutex<MeasuredRates>,
    /// Its whole last load report (for the router's `/metrics`); `None` before the first.
    report: Mutex<Option<strata_engine_api::load::EngineLoad>>,
    /// Requests routed here (first attempts and failovers).
    routed: AtomicU64,
    /// Taken out of the cluster: its supervisor ends.
    removed: AtomicBool,
    /// Connections made so far: a node that failed a request and came back (a restart) is a
    /// new incarnation, eligible again for a request it failed.
    incarnation: AtomicU64,
}

impl Node {
    /// A node at `addr` in index slot `slot`, not connected yet.
    fn new(addr: SocketAddr, slot: Slot) -> Arc<Self> {
        Arc::new(Self {
            addr,
            slot,
            ring: Mutex::new(RingMember::of_address(addr)),
            client: RwLock::new(None),
            kv_layout: RwLock::new(None),
            load: Mutex::new(NodeLoad::default()),
            rates: Mutex::new(MeasuredRates::default()),
            report: Mutex::new(None),
            routed: AtomicU64::new(0),
            removed: AtomicBool::new(false),
            incarnation: AtomicU64::new(0),
        })
    }

    /// The connection, if the node is up.
    fn client(&self) -> Option<NodeClient> {
        let client = self.client.read().unwrap_or_else(PoisonError::into_inner);
        client.as_ref().filter(|c| !c.is_closed()).cloned()
    }

    fn alive(&self) -> bool {
        !self.removed.load(Ordering::Relaxed) && self.client().is_some()
    }

    fn set_client(&self, client: Option<NodeClient>) {
        if client.is_some() {
            self.incarnation.fetch_add(1, Ordering::Relaxed);
        }
        *self.client.write().unwrap_or_else(PoisonError::into_inner) = client;
    }

    fn incarnation(&self) -> u64 {
        self.incarnation.load(Ordering::Relaxed)
    }

    /// Records what the node said about itself when it was dialed.
    fn set_info(&self, info: &NodeInfo) {
        *self
            .kv_layout
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Some(info.kv_layout.clone());
        self.load
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .capacity_blocks = info.capacity_blocks as u64;
    }

    fn ring(&self) -> RingMember {
        *self.ring.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn kv_layout(&self) -> Option<KvLayout> {
        self.kv_layout
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Counters of the routing decisions, for `/metrics` and the cluster tests.
#[derive(Debug, Default)]
pub struct ClusterStats {
    pub cache: AtomicU64,
    pub ring: AtomicU64,
    pub other: AtomicU64,
    /// Prompt blocks found cached on the chosen node, summed.
    pub cached_blocks: AtomicU64,
    /// Prompt blocks routed, summed.
    pub prompt_blocks: AtomicU64,
    pub failovers: AtomicU64,
    /// Generate calls nodes refused as busy (at their admission limit).
    pub busy_refusals: AtomicU64,
    /// Requests sent with a cross-node KV fetch, and the blocks those fetches named.
    pub kv_fetches: AtomicU64,
    pub kv_fetch_blocks: AtomicU64,
}

/// How a cluster treats failures and cached prefixes held elsewhere.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterOptions {
    /// Continue a request on another node when its node fails (on by default).
    pub failover: bool,
    /// When a node imports prompt blocks another node holds instead of computing them.
    pub kv_fetch: KvFetchConfig,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        Self {
            failover: true,
            kv_fetch: KvFetchConfig::default(),
        }
    }
}

/// The nodes behind this router.
pub struct Cluster {
    config: ModelConfig,
    block_size: usize,
    /// The smallest node's KV blocks: what admission checks a prompt against.
    device_blocks: AtomicUsize,
    grammar: Option<Arc<GrammarCompiler>>,
    nodes: RwLock<Vec<Arc<Node>>>,
    /// How supervisors dial nodes added later.
    endpoint: quinn::Endpoint,
    server_name: String,
    /// The ownership ring's epoch as the topology group last announced it (0 without one).
    ring_epoch: AtomicU64,
    /// The topology group's members as the watcher last saw them (for the dashboard).
    members: RwLock<Vec<MemberView>>,
    index: Arc<RwLock<PrefixIndex>>,
    router: Mutex<Router>,
    next_id: AtomicU64,
    cancels: Mutex<HashMap<u64, oneshot::Sender<()>>>,
    options: ClusterOptions,
    pub stats: ClusterStats,
}

impl Cluster {
    /// Connects to the nodes at `addrs` through `endpoint` (its client configuration carries
    /// this router's certificate), checks that each serves `config`'s model, and starts
    /// following their KV events and load. Nodes that cannot be reached now are redialed in the
    /// background (so are nodes that go away later); if none can be reached, or one serves
    /// another model, this fails.
    pub async fn connect(
        endpoint: &quinn::Endpoint,
        addrs: &[SocketAddr],
        server_name: &str,
        config: ModelConfig,
        grammar: Option<Arc<GrammarCompiler>>,
        router: Router,
        options: ClusterOptions,
    ) -> Result<Arc<Self>, ClusterError> {
        if addrs.is_empty() {
            return Err(ClusterError::NoNodes);
        }
        let mut index = PrefixIndex::new();
        let mut nodes = Vec::with_capacity(addrs.len());
        let mut infos = Vec::new();
        let mut unreachable = Vec::new();
        for &addr in addrs {
            let slot = index
                .add_node()
                .map_err(|e| ClusterError::Index(e.to_string()))?;
            let node = Node::new(addr, slot);
            match dial(endpoint, addr, server_name, &config).await {
                Ok((client, info)) => {
                    // The node's cache is in the index before the first request is routed (a
                    // restarted router routes as well as before at once); the supervisor then
                    // follows the events from a fresh dump.
                    match client.kv_dump().await {
                        Ok(dump) => {
                            let _ = index.load_dump(slot, &dump);
                        }
                        Err(e) => tracing::warn!("node {addr}: no initial cache dump: {e}"),
                    }
                    node.set_client(Some(client));
                    node.set_info(&info);
                    infos.push(info);
                }
                Err(e @ ClusterError::Mismatch { .. }) => return Err(e),
                Err(e) => unreachable.push(e),
            }
            nodes.push(node);
        }
        let Some(first) = infos.first() else {
            return Err(unreachable.swap_remove(0));
        };
        for e in &unreachable {
            tracing::warn!("{e}; retrying in the background");
        }
        let block_size = first.block_size;
        let device_blocks = infos.iter().map(|i| i.capacity_blocks).min().unwrap_or(0);
        let cluster = Arc::new(Self {
            config,
            block_size,
            device_blocks: AtomicUsize::new(device_blocks),
            grammar,
            index: Arc::new(RwLock::new(index)),
            nodes: RwLock::new(nodes),
            endpoint: endpoint.clone(),
            server_name: server_name.to_string(),
            ring_epoch: AtomicU64::new(0),
            members: RwLock::new(Vec::new()),
            router: Mutex::new(router),
            next_id: AtomicU64::new(1),
            cancels: Mutex::new(HashMap::new()),
            options,
            stats: ClusterStats::default(),
        });
        for node in cluster.nodes() {
            cluster.supervise(node);
        }
        Ok(cluster)
    }

    fn nodes(&self) -> Vec<Arc<Node>> {
        self.nodes
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Whether some node is connected and not removed: a request could be sent now.
    pub fn has_available_node(&self) -> bool {
        self.nodes().iter().any(|n| n.alive())
    }

    fn supervise(self: &Arc<Self>, node: Arc<Node>) {
        tokio::spawn(Supervisor::new(self, node).run());
    }

    /// The nodes' addresses, in the order they were added.
    pub fn node_addrs(&self) -> Vec<SocketAddr> {
        self.nodes().iter().map(|n| n.addr).collect()
    }

    /// Adds the node at `addr` (dialed in the background), placed on the ownership ring as
    /// `ring`; a node already there only takes the new ring place.
    pub fn add_node(
        self: &Arc<Self>,
        addr: SocketAddr,
        ring: RingMember,
    ) -> Result<(), ClusterError> {
        let mut nodes = self.nodes.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(node) = nodes.iter().find(|n| n.addr == addr) {
            *node.ring.lock().unwrap_or_else(PoisonError::into_inner) = ring;
            return Ok(());
        }
        let slot = self
            .index
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .add_node()
            .map_err(|e| ClusterError::Index(e.to_string()))?;
        let node = Node::new(addr, slot);
        *node.ring.lock().unwrap_or_else(PoisonError::into_inner) = ring;
        nodes.push(Arc::clone(&node));
        drop(nodes);
        tracing::info!("node {addr} added");
        self.supervise(node);
        Ok(())
    }

    /// Takes the node at `addr` out: no new requests go there; those running there continue
    /// elsewhere if it fails.
    pub fn remove_node(&self, addr: SocketAddr) {
        let mut nodes = self.nodes.write().unwrap_or_else(PoisonError::into_inner);
        let Some(at) = nodes.iter().position(|n| n.addr == addr) else {
            return;
        };
        let node = nodes.remove(at);
        drop(nodes);
        node.removed.store(true, Ordering::Relaxed);
        let mut index = self.index.write().unwrap_or_else(PoisonError::into_inner);
        let _ = index.remove_node(node.slot);
        tracing::info!("node {addr} removed");
    }

    /// Records the topology group's ring epoch (for `/metrics`).
    pub fn set_ring_epoch(&self, epoch: u64) {
        self.ring_epoch.store(epoch, Ordering::Relaxed);
    }

    pub fn model_config(&self) -> &ModelConfig {
        &self.config
    }

    /// Tokens per KV block on the nodes.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Pins the leading run of `hashes` each connected node has cached under `name` for `ttl`
    /// (a primed context stays where its prompt ran, or where a failover took it): every node's
    /// answer, or why it could not answer.
    pub async fn pin(
        &self,
        name: &str,
        hashes: &[BlockHash],
        ttl: Duration,
    ) -> Vec<Result<PinReport, String>> {
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        let calls = self
            .nodes()
            .into_iter()
            .filter_map(|n| n.client())
            .map(|client| {
                let (name, hashes) = (name.to_string(), hashes.to_vec());
                async move {
                    match client.pin(name, hashes, ttl_ms).await {
                        Ok(answer) => answer,
                        Err(e) => Err(e.to_string()),
                    }
                }
            });
        futures_util::future::join_all(calls).await
    }

    /// Drops the pin `name` on every connected node; whether one held it.
    pub async fn unpin(&self, name: &str) -> bool {
        let calls = self
            .nodes()
            .into_iter()
            .filter_map(|n| n.client())
            .map(|client| {
                let name = name.to_string();
                async move { client.unpin(name).await.unwrap_or(false) }
            });
        futures_util::future::join_all(calls)
            .await
            .into_iter()
            .any(|held| held)
    }

    /// Every connected node's pins (a name held by several nodes appears once per node).
    pub async fn pins(&self) -> Vec<PinReport> {
        let calls = self
            .nodes()
            .into_iter()
            .filter_map(|n| n.client())
            .map(|client| async move { client.pins().await.unwrap_or_default() });
        futures_util::future::join_all(calls)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    /// Each node's last load report, by node address (nodes that have not reported yet are left
    /// out).
    pub fn node_loads(&self) -> Vec<(String, strata_engine_api::load::EngineLoad)> {
        self.nodes()
            .iter()
            .filter_map(|n| {
                let report = *n.report.lock().unwrap_or_else(PoisonError::into_inner);
                report.map(|load| (n.addr.to_string(), load))
            })
            .collect()
    }

    /// Requests routed to each node so far, by node address.
    pub fn routed(&self) -> Vec<(SocketAddr, u64)> {
        self.nodes()
            .iter()
            .map(|n| (n.addr, n.routed.load(Ordering::Relaxed)))
            .collect()
    }

    /// The routing families for `/metrics`, read when a scrape encodes them.
    pub fn metrics(self: &Arc<Self>) -> Box<dyn prometheus_client::collector::Collector> {
        Box::new(metrics::RoutingMetrics(self.clone()))
    }

    /// Admits `request` with the engine's checks, routes it and starts relaying its events.
    /// Must be called from within the tokio runtime.
    pub fn submit(
        self: &Arc<Self>,
        request: GenerateRequest,
    ) -> Result<RequestStream, SubmitError> {
        let admission = Admission {
            config: &self.config,
            block_size: self.block_size,
            device_blocks: self.device_blocks.load(Ordering::Relaxed),
            // Pins are one node's state; the node that takes the request checks them.
            pinned_blocks: 0,
            grammar: self.grammar.as_deref(),
            // The node that takes the request decides (a tensor-parallel node refuses).
            embeds: true,
        };
        admission.admit(&request)?;
        // Refused before any stream starts (503 with Retry-After on every surface), rather than
        // a stream that opens and then fails.
        if !self.has_available_node() {
            return Err(SubmitError::Remote(Refusal {
                kind: RefusalKind::Unavailable,
                message: "no node is reachable from this router; retry later".to_string(),
            }));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, events) = unbounded_channel();
        let (cancel, cancelled) = oneshot::channel();
        self.cancels
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id, cancel);
        let cluster = Arc::clone(self);
        tokio::spawn(async move {
            cluster.relay(request, tx, cancelled).await;
            cluster
                .cancels
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&id);
        });
        Ok(RequestStream { id, events })
    }

    /// Stops request `id` wherever it runs.
    pub fn cancel(&self, id: u64) {
        let cancel = self
            .cancels
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id);
        if let Some(cancel) = cancel {
            let _ = cancel.send(());
        }
    }

    /// The node for `request`, among the live ones not in `exclude`, and the prompt blocks it
    /// should fetch from another node first, if that pays.
    fn route(
        &self,
        request: &GenerateRequest,
        exclude: &[Slot],
    ) -> Option<(Arc<Node>, Option<KvFetch>)> {
        let bs = self.block_size;
        let chain = prompt_block_hashes(&request.prompt, bs, request.cache_salt);
        let prefix_key = match chain.first() {
            Some(h) => h.0,
            None => block_hash(None, &request.prompt, request.cache_salt).0,
        };
        let nodes = self.nodes();
        let candidates: Vec<Candidate> = nodes
            .iter()
            .filter(|n| n.alive() && !exclude.contains(&n.slot))
            .map(|n| {
                let ring = n.ring();
                Candidate {
                    slot: n.slot,
                    ring_id: ring.id,
                    vnodes: ring.vnodes,
                    load: *n.load.lock().unwrap_or_else(PoisonError::into_inner),
                }
            })
            .collect();
        let decision = {
            let index = self.index.read().unwrap_or_else(PoisonError::into_inner);
            self.router
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .route(&index, &candidates, &chain, prefix_key, bs)?
        };
        let counter = match decision.reason {
            Reason::Cache => &self.stats.cache,
            Reason::Ring => &self.stats.ring,
            _ => &self.stats.other,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        self.stats
            .cached_blocks
            .fetch_add(u64::from(decision.cached_blocks), Ordering::Relaxed);
        self.stats
            .prompt_blocks
            .fetch_add(chain.len() as u64, Ordering::Relaxed);
        let node = nodes.iter().find(|n| n.slot == decision.slot)?;
        node.routed.fetch_add(1, Ordering::Relaxed);
        let fetch = decision.holder.and_then(|(slot, held)| {
            let holder = nodes
                .iter()
                .find(|n| n.slot == slot && n.slot != node.slot)?;
            let layout = node
                .kv_layout()
                .filter(|l| Some(l) == holder.kv_layout().as_ref())?;
            let rates = measured_rates(node, &nodes, &layout);
            let (from, to) = self.options.kv_fetch.with_measured(rates).plan(
                decision.cached_blocks,
                held,
                layout.block_bytes,
                bs,
            )?;
            self.stats.kv_fetches.fetch_add(1, Ordering::Relaxed);
            self.stats
                .kv_fetch_blocks
                .fetch_add(u64::from(to - from), Ordering::Relaxed);
            Some(KvFetch {
                peer: holder.addr,
                from,
                to,
            })
        });
        // Count the request against the node until its next load report (minus what it will
        // fetch rather than compute).
        let fetched_tokens = fetch.map_or(0, |f| u64::from(f.to - f.from) * bs as u64);
        node.load
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .queued_prefill_tokens += (request.prompt.len() as u64).saturating_sub(fetched_tokens);
        Some((Arc::clone(node), fetch))
    }
}

/// The rates to judge a fetch to `node` by: its own measurements, and for a rate it has not
/// measured yet, the mean of what the nodes with the same KV layout (the same backend and model)
/// measured; zero where none has.
fn measured_rates(node: &Node, nodes: &[Arc<Node>], layout: &KvLayout) -> MeasuredRates {
    let own = *node.rates.lock().unwrap_or_else(PoisonError::into_inner);
    let peers: Vec<MeasuredRates> = nodes
        .iter()
        .filter(|n| n.kv_layout().as_ref() == Some(layout))
        .map(|n| *n.rates.lock().unwrap_or_else(PoisonError::into_inner))
        .collect();
    let mean = |rate: fn(&MeasuredRates) -> u64| {
        let measured: Vec<u64> = peers.iter().map(rate).filter(|&r| r > 0).collect();
        measured.iter().sum::<u64>() / (measured.len() as u64).max(1)
    };
    MeasuredRates {
        tokens_per_s: match own.tokens_per_s {
            0 => mean(|r| r.tokens_per_s),
            own => own,
        },
        fetch_bytes_per_s: match own.fetch_bytes_per_s {
            0 => mean(|r| r.fetch_bytes_per_s),
            own => own,
        },
    }
}

/// A node on the ownership ring: the member id and virtual node count the topology group's
/// ring gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingMember {
    pub id: u64,
    pub vnodes: u32,
}

impl RingMember {
    /// A node known only by its address (`strata router --nodes`): a hash of the address as its
    /// id, one GPU's virtual nodes. Every router given the same addresses agrees on it.
    pub fn of_address(addr: SocketAddr) -> Self {
        Self {
            id: xxhash_rust::xxh3::xxh3_64(addr.to_string().as_bytes()),
            vnodes: VNODES_PER_GPU,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(backend: &str) -> KvLayout {
        KvLayout {
            backend: backend.into(),
            model_type: "llama".into(),
            num_layers: 4,
            num_kv_heads: 4,
            head_dim: 64,
            block_size: 16,
            block_bytes: 131_072,
        }
    }

    /// A node that has not measured a rate is judged by its peers of the same layout, never by
    /// nodes of another backend.
    #[test]
    fn unmeasured_rates_come_from_peers_of_the_same_layout() {
        let mut index = PrefixIndex::new();
        let mut node = |port: u16, backend: &str, tokens: u64, fetch: u64| {
            let n = Node::new(
                SocketAddr::from(([127, 0, 0, 1], port)),
                index.add_node().unwrap(),
            );
            *n.kv_layout.write().unwrap() = Some(layout(backend));
            *n.rates.lock().unwrap() = MeasuredRates {
                tokens_per_s: tokens,
                fetch_bytes_per_s: fetch,
            };
            n
        };
        let fresh = node(1, "cpu", 0, 0);
        let nodes = vec![
            Arc::clone(&fresh),
            node(2, "cpu", 1_000, 0),
            node(3, "cpu", 3_000, 200),
            node(4, "cuda", 30_000, 9_000),
        ];
        let rates = measured_rates(&fresh, &nodes, &layout("cpu"));
        assert_eq!(rates.tokens_per_s, 2_000);
        assert_eq!(rates.fetch_bytes_per_s, 200);
        // Its own measurements win once it has them.
        *fresh.rates.lock().unwrap() = MeasuredRates {
            tokens_per_s: 500,
            fetch_bytes_per_s: 0,
        };
        assert_eq!(
            measured_rates(&fresh, &nodes, &layout("cpu")),
            MeasuredRates {
                tokens_per_s: 500,
                fetch_bytes_per_s: 200
            }
        );
        // Nobody of its layout measured anything: zero, and the configured priors apply.
        let alone = node(5, "tpu", 0, 0);
        assert_eq!(
            measured_rates(&alone, &nodes, &layout("tpu")),
            MeasuredRates::default()
        );
    }
}
