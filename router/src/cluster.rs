//! The router's view of its nodes (DESIGN.md §2, §6): a QUIC connection to each, the prefix
//! index fed by their KV events, their load, and the routing policy that picks one per request.
//!
//! A request is admitted here with the engine's own checks ([`Admission`]), routed, and relayed
//! from the node it went to. If that node fails mid-stream (its connection drops, it dies), the
//! request continues on another node from where it stood ([`Resume`]: the tokens already
//! emitted and the sampler's RNG position), so the client sees the same stream as without the
//! failure, sampled or greedy. A node whose connection has ended takes no more requests; at most
//! one retry per other node is made, then the stream fails with the reasons.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use strata_model::ModelConfig;
use strata_model::grammar::GrammarCompiler;
use strata_node::kv::{block_hash, prompt_block_hashes};
use strata_node::rpc::{KvFeed, NodeClient, NodeError, NodeInfo, RemoteStream};
use strata_node::{Admission, RequestStream, SubmitError};
use strata_protocol::{GenerateRequest, Resume, TokenEvent};
use tokio::sync::mpsc::{UnboundedSender, unbounded_channel};
use tokio::sync::oneshot;

use crate::routing::{Candidate, NodeLoad, PrefixIndex, Reason, Router, Slot};

/// How often each node's load is asked for.
const LOAD_INTERVAL: Duration = Duration::from_millis(50);
/// How long a node's KV feed waits before resubscribing after an error.
const FEED_RETRY: Duration = Duration::from_millis(200);

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
    client: NodeClient,
    slot: Slot,
    ring_key: u64,
    info: NodeInfo,
    load: Mutex<NodeLoad>,
    alive: AtomicBool,
    /// Requests routed here (first attempts and failovers).
    routed: AtomicU64,
}

impl Node {
    fn alive(&self) -> bool {
        self.alive.load(Ordering::Relaxed) && !self.client.is_closed()
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
}

/// The nodes behind this router.
pub struct Cluster {
    config: ModelConfig,
    block_size: usize,
    device_blocks: usize,
    grammar: Option<Arc<GrammarCompiler>>,
    nodes: Vec<Arc<Node>>,
    index: Arc<RwLock<PrefixIndex>>,
    router: Mutex<Router>,
    next_id: AtomicU64,
    cancels: Mutex<HashMap<u64, oneshot::Sender<()>>>,
    /// Continue a request on another node when its node fails (on by default).
    failover: bool,
    pub stats: ClusterStats,
}

impl Cluster {
    /// Connects to every node in `addrs` through `endpoint` (its client configuration carries
    /// this router's certificate), checks that each serves `config`'s model, and starts
    /// following their KV events and load.
    pub async fn connect(
        endpoint: &quinn::Endpoint,
        addrs: &[SocketAddr],
        server_name: &str,
        config: ModelConfig,
        grammar: Option<Arc<GrammarCompiler>>,
        router: Router,
        failover: bool,
    ) -> Result<Arc<Self>, ClusterError> {
        if addrs.is_empty() {
            return Err(ClusterError::NoNodes);
        }
        let mut index = PrefixIndex::new();
        let mut nodes = Vec::with_capacity(addrs.len());
        for &addr in addrs {
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
            let slot = index
                .add_node()
                .map_err(|e| ClusterError::Index(e.to_string()))?;
            nodes.push(Arc::new(Node {
                client,
                slot,
                ring_key: ring_key(addr),
                load: Mutex::new(NodeLoad {
                    capacity_blocks: info.capacity_blocks as u64,
                    ..NodeLoad::default()
                }),
                info,
                alive: AtomicBool::new(true),
                routed: AtomicU64::new(0),
            }));
        }
        let block_size = nodes[0].info.block_size;
        let device_blocks = nodes.iter().map(|n| n.info.capacity_blocks).min();
        let cluster = Arc::new(Self {
            config,
            block_size,
            device_blocks: device_blocks.unwrap_or(0),
            grammar,
            index: Arc::new(RwLock::new(index)),
            nodes,
            router: Mutex::new(router),
            next_id: AtomicU64::new(1),
            cancels: Mutex::new(HashMap::new()),
            failover,
            stats: ClusterStats::default(),
        });
        for node in &cluster.nodes {
            tokio::spawn(follow_kv(Arc::clone(node), Arc::clone(&cluster.index)));
            tokio::spawn(follow_load(Arc::clone(node)));
        }
        Ok(cluster)
    }

    pub fn model_config(&self) -> &ModelConfig {
        &self.config
    }

    /// Requests routed to each node so far, by node address.
    pub fn routed(&self) -> Vec<(SocketAddr, u64)> {
        self.nodes
            .iter()
            .map(|n| (n.client.addr(), n.routed.load(Ordering::Relaxed)))
            .collect()
    }

    /// The routing counters in Prometheus text: decisions by reason, requests per node, prompt
    /// blocks found cached where they were sent, failovers.
    pub fn render_metrics(&self) -> String {
        use std::fmt::Write;
        let s = &self.stats;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP strata_router_decisions_total Routing decisions by reason.\n\
             # TYPE strata_router_decisions_total counter"
        );
        for (reason, n) in [("cache", &s.cache), ("ring", &s.ring), ("other", &s.other)] {
            let n = n.load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "strata_router_decisions_total{{reason=\"{reason}\"}} {n}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP strata_router_node_requests_total Requests sent to each node.\n\
             # TYPE strata_router_node_requests_total counter"
        );
        for (addr, n) in self.routed() {
            let _ = writeln!(
                out,
                "strata_router_node_requests_total{{node=\"{addr}\"}} {n}"
            );
        }
        for (name, help, value) in [
            (
                "strata_router_prompt_blocks_total",
                "Full prompt blocks of routed requests.",
                &s.prompt_blocks,
            ),
            (
                "strata_router_cached_blocks_total",
                "Of those, blocks cached on the node chosen.",
                &s.cached_blocks,
            ),
            (
                "strata_router_failovers_total",
                "Requests continued on another node after theirs failed.",
                &s.failovers,
            ),
        ] {
            let value = value.load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
            );
        }
        out
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
            device_blocks: self.device_blocks,
            grammar: self.grammar.as_deref(),
        };
        admission.admit(&request)?;
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

    /// The node for `request`, among the live ones not in `exclude`.
    fn route(&self, request: &GenerateRequest, exclude: &[Slot]) -> Option<Arc<Node>> {
        let bs = self.block_size;
        let chain = prompt_block_hashes(&request.prompt, bs, request.cache_salt);
        let prefix_key = match chain.first() {
            Some(h) => h.0,
            None => block_hash(None, &request.prompt, request.cache_salt).0,
        };
        let candidates: Vec<Candidate> = self
            .nodes
            .iter()
            .filter(|n| n.alive() && !exclude.contains(&n.slot))
            .map(|n| Candidate {
                slot: n.slot,
                ring_key: n.ring_key,
                load: *n.load.lock().unwrap_or_else(PoisonError::into_inner),
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
        let node = self.nodes.iter().find(|n| n.slot == decision.slot)?;
        node.routed.fetch_add(1, Ordering::Relaxed);
        // Count the request against the node until its next load report.
        node.load
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .queued_prefill_tokens += request.prompt.len() as u64;
        Some(Arc::clone(node))
    }

    /// Runs `request` on a node, moving it to another when its node fails, until it ends, the
    /// client goes away, or it is cancelled.
    async fn relay(
        &self,
        request: GenerateRequest,
        tx: UnboundedSender<TokenEvent>,
        mut cancelled: oneshot::Receiver<()>,
    ) {
        let prompt_tokens = request.prompt.len() as u32;
        let mut emitted: Vec<u32> = Vec::new();
        let mut rng_pos = 0;
        let mut tried: Vec<Slot> = Vec::new();
        let mut failures: Vec<String> = Vec::new();
        loop {
            let Some(attempt) = resumed(&request, &emitted, rng_pos) else {
                // The budget was spent exactly when the node failed: the stream is complete.
                let _ = tx.send(TokenEvent::Finished {
                    reason: strata_protocol::FinishReason::Length,
                    usage: strata_protocol::Usage {
                        prompt_tokens,
                        completion_tokens: emitted.len() as u32,
                        cached_tokens: 0,
                    },
                });
                return;
            };
            let Some(node) = self.route(&attempt, &tried) else {
                let why = if failures.is_empty() {
                    "no node is available".to_string()
                } else {
                    format!("no node could finish the request: {}", failures.join("; "))
                };
                let _ = tx.send(TokenEvent::Failed { message: why });
                return;
            };
            tried.push(node.slot);
            if !emitted.is_empty() {
                self.stats.failovers.fetch_add(1, Ordering::Relaxed);
            }
            let mut stream = match node.client.generate(attempt.clone()).await {
                Ok(stream) => stream,
                Err(NodeError::Refused(refusal)) => {
                    let _ = tx.send(TokenEvent::Failed {
                        message: refusal.message,
                    });
                    return;
                }
                Err(e) => {
                    node_failed(&node, &e);
                    failures.push(e.to_string());
                    continue;
                }
            };
            match self
                .forward(&mut stream, &tx, &mut cancelled, &mut emitted, &mut rng_pos)
                .await
            {
                Forwarded::Done => return,
                Forwarded::Stopped => {
                    stream.cancel();
                    return;
                }
                Forwarded::NodeFailed(e) => {
                    node_failed(&node, &e);
                    if !self.failover {
                        let message = format!("the node running the request failed: {e}");
                        let _ = tx.send(TokenEvent::Failed { message });
                        return;
                    }
                    failures.push(e.to_string());
                }
            }
        }
    }

    /// Relays one node's events until the request ends or the node fails, keeping the tokens
    /// emitted and the sampler's position for a continuation.
    async fn forward(
        &self,
        stream: &mut RemoteStream,
        tx: &UnboundedSender<TokenEvent>,
        cancelled: &mut oneshot::Receiver<()>,
        emitted: &mut Vec<u32>,
        rng_pos: &mut u64,
    ) -> Forwarded {
        loop {
            let event = tokio::select! {
                event = stream.next() => event,
                _ = &mut *cancelled => return Forwarded::Stopped,
                () = tx.closed() => return Forwarded::Stopped,
            };
            let event = match event {
                Ok(Some(event)) => event,
                Ok(None) => return Forwarded::Done,
                Err(e) => return Forwarded::NodeFailed(e),
            };
            if let TokenEvent::Token {
                id, rng_pos: pos, ..
            } = &event
            {
                emitted.push(*id);
                *rng_pos = *pos;
            }
            let last = !matches!(event, TokenEvent::Token { .. });
            if tx.send(event).is_err() {
                return Forwarded::Stopped;
            }
            if last {
                return Forwarded::Done;
            }
        }
    }
}

enum Forwarded {
    Done,
    Stopped,
    NodeFailed(NodeError),
}

/// `request` continued after `emitted` tokens, the last drawn with the RNG ending at `rng_pos`;
/// `None` when nothing is left to generate.
fn resumed(request: &GenerateRequest, emitted: &[u32], rng_pos: u64) -> Option<GenerateRequest> {
    let mut next = request.clone();
    if emitted.is_empty() {
        return Some(next);
    }
    if emitted.len() >= next.sampling.max_tokens as usize {
        return None;
    }
    next.resume = Some(Resume {
        output: emitted.to_vec(),
        rng_pos,
    });
    Some(next)
}

fn node_failed(node: &Node, e: &NodeError) {
    if node.client.is_closed() {
        node.alive.store(false, Ordering::Relaxed);
    }
    tracing::warn!("node {} failed a request: {e}", node.client.addr());
}

/// A node's stable key on the ownership ring: a hash of its address.
fn ring_key(addr: SocketAddr) -> u64 {
    xxhash_rust::xxh3::xxh3_64(addr.to_string().as_bytes())
}

/// Keeps `node`'s part of the index current: subscribe, then dump, then apply events; a gap, a
/// lag or an error starts over.
async fn follow_kv(node: Arc<Node>, index: Arc<RwLock<PrefixIndex>>) {
    while node.alive() {
        if let Err(e) = follow_kv_once(&node, &index).await {
            tracing::debug!("KV feed of node {}: {e}", node.client.addr());
        }
        tokio::time::sleep(FEED_RETRY).await;
    }
    let mut index = index.write().unwrap_or_else(PoisonError::into_inner);
    let _ = index.clear_node(node.slot);
}

async fn follow_kv_once(node: &Node, index: &RwLock<PrefixIndex>) -> Result<(), String> {
    let mut feed = node.client.kv_events().await.map_err(|e| e.to_string())?;
    let dump = node.client.kv_dump().await.map_err(|e| e.to_string())?;
    index
        .write()
        .unwrap_or_else(PoisonError::into_inner)
        .load_dump(node.slot, &dump)
        .map_err(|e| e.to_string())?;
    loop {
        match feed.next().await.map_err(|e| e.to_string())? {
            Some(KvFeed::Event(event)) => index
                .write()
                .unwrap_or_else(PoisonError::into_inner)
                .apply(node.slot, &event)
                .map_err(|e| e.to_string())?,
            Some(KvFeed::Lagged { missed }) => {
                return Err(format!("fell {missed} events behind"));
            }
            None => return Err("the node ended its feed".into()),
        }
    }
}

/// Polls `node`'s load while it lives.
async fn follow_load(node: Arc<Node>) {
    let mut tick = tokio::time::interval(LOAD_INTERVAL);
    while node.alive() {
        tick.tick().await;
        match node.client.load().await {
            Ok(load) => {
                *node.load.lock().unwrap_or_else(PoisonError::into_inner) = NodeLoad {
                    queued_prefill_tokens: load.queued_prefill_tokens,
                    active_blocks: load.active_blocks,
                    capacity_blocks: load.capacity_blocks,
                };
            }
            Err(e) if node.client.is_closed() => {
                tracing::warn!("node {} is gone: {e}", node.client.addr());
                node.alive.store(false, Ordering::Relaxed);
            }
            Err(_) => {}
        }
    }
}
