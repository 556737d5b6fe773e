//! The node side: accepts routers' (and peer nodes') connections, one call per stream.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use strata_protocol::GenerateRequest;
use strata_quic::{FrameError, read_frame, write_frame, write_frame_bytes};
use tokio::sync::broadcast::error::RecvError;

use super::{
    GenerateCall, GenerateFrame, KvBlockPayload, KvExportHead, KvFeed, KvFetch, NodeClient,
    NodeInfo, NodeRequest, PinReport, Refusal, RefusalKind, pin_report,
};
use crate::Engine;
use crate::engine::average_rate;
use crate::kv::{BlockHash, KvLayout, prompt_block_hashes};
use crate::scheduler::EngineLoad;

/// The most blocks one `KvExport` call answers (it holds them in memory at once); an importer
/// asks for longer runs in calls of [`FETCH_CHUNK`].
const MAX_EXPORT_BLOCKS: usize = 256;
/// Blocks an importer asks a peer for per call.
const FETCH_CHUNK: usize = 64;

/// The engine a node serves, and what it says about itself.
pub struct NodeService {
    engine: Arc<Engine>,
    info: NodeInfo,
    peers: Option<Peers>,
    stats: FetchStats,
    peer_check: Option<PeerCheck>,
    /// Generate calls this node holds at most (running and waiting in its engine); more are
    /// refused as [`RefusalKind::Busy`]. `None`: no limit of its own.
    max_calls: Option<usize>,
    /// Generate calls held now.
    calls: Arc<AtomicUsize>,
    /// Set when the node is stopping: every new generate call is refused as busy.
    draining: Arc<std::sync::atomic::AtomicBool>,
}

/// One generate call counted against the node's admission limit while it lives.
struct CallSlot(Arc<AtomicUsize>);

impl Drop for CallSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How a node reaches its peers to fetch KV blocks: an endpoint whose client configuration
/// carries the node's certificate, the name peers' certificates are checked for, and how long a
/// fetch may take before the request computes its prefix instead.
pub struct Peers {
    endpoint: quinn::Endpoint,
    server_name: String,
    timeout: Duration,
    clients: tokio::sync::Mutex<HashMap<SocketAddr, NodeClient>>,
}

impl Peers {
    pub fn new(endpoint: quinn::Endpoint, server_name: &str, timeout: Duration) -> Self {
        Self {
            endpoint,
            server_name: server_name.to_string(),
            timeout,
            clients: tokio::sync::Mutex::new(HashMap::new()),
        }
    }

    /// A live connection to `addr`, dialed if there is none.
    async fn client(&self, addr: SocketAddr) -> Result<NodeClient, super::NodeError> {
        let mut clients = self.clients.lock().await;
        if let Some(client) = clients.get(&addr).filter(|c| !c.is_closed()) {
            return Ok(client.clone());
        }
        let client = NodeClient::connect(&self.endpoint, addr, &self.server_name).await?;
        clients.insert(addr, client.clone());
        Ok(client)
    }
}

/// Decides whether a peer may still call this node, from its leaf certificate (DER): `Some(why)`
/// refuses. A node serving beside a topology member refuses the certificates its group revoked.
pub type PeerCheck = Arc<dyn Fn(&[u8]) -> Option<String> + Send + Sync>;

/// What a node's fetches brought, for the rate it reports with its load.
#[derive(Debug, Default)]
struct FetchStats {
    /// Blocks imported from peers.
    imported_blocks: AtomicU64,
    /// Bytes per second fetches achieved (from asking to imported), a moving average.
    bytes_per_s: AtomicU64,
}

impl NodeService {
    pub fn new(engine: Arc<Engine>, tp: usize) -> Self {
        let config = engine.model_config();
        let info = NodeInfo {
            model_type: config.architecture.model_type().to_string(),
            vocab_size: config.vocab_size,
            max_position_embeddings: config.max_position_embeddings,
            block_size: engine.block_size(),
            capacity_blocks: engine.load().capacity_blocks as usize,
            tp,
            kv_layout: engine.kv_layout().clone(),
        };
        Self {
            engine,
            info,
            peers: None,
            stats: FetchStats::default(),
            peer_check: None,
            max_calls: None,
            calls: Arc::new(AtomicUsize::new(0)),
            draining: Arc::default(),
        }
    }

    /// Refuses every new generate call as busy from now on (the node is stopping); calls in
    /// flight run to their end.
    pub fn drain(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Generate calls held now (running and waiting).
    pub fn calls_held(&self) -> usize {
        self.calls.load(Ordering::Acquire)
    }

    /// The engine behind the service.
    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// Holds at most `max` generate calls at once (running and waiting); the next is refused
    /// as busy, so that a router sends it to another node or queues it itself.
    pub fn with_max_calls(mut self, max: usize) -> Self {
        self.max_calls = Some(max.max(1));
        self
    }

    /// A slot for one more generate call, unless the node holds its limit already.
    fn admit(&self) -> Option<CallSlot> {
        let held = self.calls.fetch_add(1, Ordering::AcqRel);
        let slot = CallSlot(Arc::clone(&self.calls));
        match self.max_calls {
            Some(max) if held >= max => None,
            _ => Some(slot),
        }
    }

    /// Refuses callers `check` refuses: their connection is closed at its next call.
    pub fn with_peer_check(mut self, check: PeerCheck) -> Self {
        self.peer_check = Some(check);
        self
    }

    /// Lets the node fetch KV blocks from peers when a call asks it to; without peers such
    /// calls run as if they had not asked.
    pub fn with_peers(mut self, peers: Peers) -> Self {
        self.peers = Some(peers);
        self
    }

    pub fn info(&self) -> &NodeInfo {
        &self.info
    }

    /// Imports `fetch`'s blocks of `request`'s prompt from its peer, within the peers' timeout.
    /// Returns the blocks imported; failures are logged, never the request's.
    async fn fetch(&self, request: &GenerateRequest, fetch: KvFetch) -> usize {
        let Some(peers) = &self.peers else {
            return 0;
        };
        let chain = prompt_block_hashes(
            &request.prompt,
            self.engine.block_size(),
            request.cache_salt,
        );
        let to = (fetch.to as usize).min(chain.len());
        let from = (fetch.from as usize).min(to);
        if from == to {
            return 0;
        }
        let parent = from.checked_sub(1).map(|i| chain[i]);
        let started = std::time::Instant::now();
        let imported_before = self.stats.imported_blocks.load(Ordering::Relaxed);
        let fetched = tokio::time::timeout(
            peers.timeout,
            self.import_run(peers, fetch.peer, parent, &chain[from..to]),
        )
        .await;
        // The rate counts what arrived in the time spent, cut short by the timeout or not (a
        // slow peer must look slow); fetches running at once on this node blur it a little.
        let arrived = self.stats.imported_blocks.load(Ordering::Relaxed) - imported_before;
        if arrived > 0 {
            let seconds = started.elapsed().as_secs_f64().max(1e-9);
            let bytes = (arrived as usize * self.engine.kv_layout().block_bytes) as f64;
            let rate = &self.stats.bytes_per_s;
            rate.store(
                average_rate(rate.load(Ordering::Relaxed), bytes / seconds),
                Ordering::Relaxed,
            );
        }
        let outcome = match fetched {
            Ok(outcome) => outcome,
            Err(_) => Err(format!(
                "no answer within {:?} ({arrived} blocks arrived)",
                peers.timeout
            )),
        };
        match outcome {
            Ok(n) => {
                let seconds = started.elapsed().as_secs_f64();
                tracing::debug!(
                    "imported {n} KV blocks from {} in {:.1} ms",
                    fetch.peer,
                    seconds * 1e3
                );
                n
            }
            Err(e) => {
                tracing::warn!("KV fetch from {}: {e}; computing instead", fetch.peer);
                0
            }
        }
    }

    /// Asks `peer` for `run` (after `parent`) in chunks and imports each; stops where the peer's
    /// cached run ends. The next chunk is asked for before this one is imported, so the transfer
    /// and the import overlap. Blocks imported before an error stay cached.
    async fn import_run(
        &self,
        peers: &Peers,
        peer: SocketAddr,
        mut parent: Option<BlockHash>,
        run: &[BlockHash],
    ) -> Result<usize, String> {
        let client = peers.client(peer).await.map_err(|e| e.to_string())?;
        let ask = |chunk: &[BlockHash]| {
            let (client, hashes) = (client.clone(), chunk.to_vec());
            AbortOnDrop(tokio::spawn(async move { client.kv_export(hashes).await }))
        };
        let mut chunks = run.chunks(FETCH_CHUNK);
        let mut next = chunks.next().map(|chunk| (chunk, ask(chunk)));
        let mut imported = 0;
        while let Some((chunk, mut answer)) = next.take() {
            let (layout, blocks) = (&mut answer.0)
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())?;
            next = chunks.next().map(|chunk| (chunk, ask(chunk)));
            check_export(self.engine.kv_layout(), chunk, &layout, &blocks)?;
            let complete = blocks.len() == chunk.len();
            let Some(&(last, _)) = blocks.last() else {
                break;
            };
            let engine = Arc::clone(&self.engine);
            let cached = tokio::task::spawn_blocking(move || engine.kv_import(parent, blocks))
                .await
                .map_err(|e| e.to_string())?
                .map_err(|e| e.to_string())?;
            imported += cached;
            self.stats
                .imported_blocks
                .fetch_add(cached as u64, Ordering::Relaxed);
            if !complete || cached < chunk.len() {
                break;
            }
            parent = Some(last);
        }
        Ok(imported)
    }
}

/// A spawned task that is stopped when its handle is dropped (a fetch that ends early does not
/// leave the chunk it asked for ahead running).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Serves `endpoint` (whose server configuration requires client certificates from the cluster
/// CA) until it is closed.
pub async fn serve(endpoint: quinn::Endpoint, service: Arc<NodeService>) {
    while let Some(incoming) = endpoint.accept().await {
        let service = Arc::clone(&service);
        tokio::spawn(async move {
            match incoming.await {
                Ok(connection) => serve_connection(connection, service).await,
                // A peer without a certificate from the cluster CA ends here.
                Err(e) => tracing::warn!("node RPC: handshake refused: {e}"),
            }
        });
    }
}

/// The leaf certificate the peer presented, DER.
fn peer_leaf(connection: &quinn::Connection) -> Option<Vec<u8>> {
    let identity = connection.peer_identity()?;
    let chain = identity
        .downcast::<Vec<quinn::rustls::pki_types::CertificateDer<'static>>>()
        .ok()?;
    chain.first().map(|c| c.as_ref().to_vec())
}

async fn serve_connection(connection: quinn::Connection, service: Arc<NodeService>) {
    let peer = connection.remote_address();
    let leaf = peer_leaf(&connection);
    loop {
        match connection.accept_bi().await {
            Ok((send, recv)) => {
                // Checked at every call: a certificate revoked while its connection is open
                // stops working at its next call.
                if let (Some(check), Some(leaf)) = (&service.peer_check, &leaf)
                    && let Some(why) = check(leaf)
                {
                    tracing::warn!("node RPC from {peer}: refused: {why}");
                    connection.close(2u32.into(), why.as_bytes());
                    return;
                }
                let service = Arc::clone(&service);
                tokio::spawn(async move {
                    if let Err(e) = serve_stream(send, recv, &service).await {
                        tracing::debug!("node RPC from {peer}: {e}");
                    }
                });
            }
            Err(_) => return,
        }
    }
}

async fn serve_stream(
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    service: &NodeService,
) -> Result<(), FrameError> {
    let request = match read_frame::<NodeRequest>(&mut recv).await {
        Ok(Some(request)) => request,
        Ok(None) => return Ok(()),
        Err(e) => {
            tracing::warn!("node RPC: malformed call refused: {e}");
            let message = format!("malformed call: {e}");
            return refuse(send, RefusalKind::Unavailable, message).await;
        }
    };
    let engine = &service.engine;
    match request {
        NodeRequest::Generate(call) => {
            if service.draining.load(Ordering::Acquire) {
                let message = "the node is stopping; retry on another node".into();
                return refuse(send, RefusalKind::Busy, message).await;
            }
            let Some(_slot) = service.admit() else {
                let message = format!(
                    "the node holds its limit of {} requests; retry on another node or later",
                    service.max_calls.unwrap_or_default()
                );
                return refuse(send, RefusalKind::Busy, message).await;
            };
            let GenerateCall { request, fetch } = *call;
            if let Some(fetch) = fetch {
                service.fetch(&request, fetch).await;
            }
            generate(&mut send, engine, request).await?
        }
        NodeRequest::KvExport { mut hashes } => {
            hashes.truncate(MAX_EXPORT_BLOCKS);
            let exporter = Arc::clone(engine);
            match tokio::task::spawn_blocking(move || exporter.kv_export(hashes)).await {
                Ok(Ok(blocks)) => {
                    let head = KvExportHead {
                        layout: engine.kv_layout().clone(),
                        blocks: blocks.len() as u32,
                    };
                    write_frame(&mut send, &head).await?;
                    for (hash, bytes) in blocks {
                        match KvBlockPayload::encode(hash, bytes) {
                            Ok(frame) => write_frame_bytes(&mut send, &frame).await?,
                            Err(e) => {
                                tracing::error!("KV export: {e}");
                                send.reset(quinn::VarInt::from_u32(1))?;
                                return Ok(());
                            }
                        }
                    }
                }
                _ => send.reset(quinn::VarInt::from_u32(1))?,
            }
        }
        NodeRequest::Pin {
            name,
            hashes,
            ttl_ms,
        } => {
            let engine = Arc::clone(engine);
            // A time to live past what the clock can name pins for good, as no expiry does.
            let expires = Instant::now().checked_add(Duration::from_millis(ttl_ms));
            let pinned =
                tokio::task::spawn_blocking(move || engine.pin(name, hashes, expires)).await;
            let answer: Result<PinReport, String> = match pinned {
                Ok(Ok(Ok(status))) => Ok(pin_report(status)),
                Ok(Ok(Err(e))) => Err(e.to_string()),
                Ok(Err(e)) => Err(e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            write_frame(&mut send, &answer).await?
        }
        NodeRequest::Unpin { name } => {
            let engine = Arc::clone(engine);
            let held = tokio::task::spawn_blocking(move || engine.unpin(name)).await;
            write_frame(&mut send, &matches!(held, Ok(Ok(true)))).await?
        }
        NodeRequest::Pins => {
            let engine = Arc::clone(engine);
            let pins = tokio::task::spawn_blocking(move || engine.pins()).await;
            let reports: Vec<PinReport> = match pins {
                Ok(Ok((statuses, _))) => statuses.into_iter().map(pin_report).collect(),
                _ => Vec::new(),
            };
            write_frame(&mut send, &reports).await?
        }
        NodeRequest::Load => {
            let load = EngineLoad {
                fetch_bytes_per_s: service.stats.bytes_per_s.load(Ordering::Relaxed),
                ..engine.load()
            };
            write_frame(&mut send, &load).await?
        }
        NodeRequest::Info => write_frame(&mut send, &service.info).await?,
        NodeRequest::KvDump => {
            let engine = Arc::clone(engine);
            let dump = tokio::task::spawn_blocking(move || engine.kv_dump()).await;
            match dump {
                Ok(Ok(dump)) => write_frame(&mut send, &dump).await?,
                _ => send.reset(quinn::VarInt::from_u32(1))?,
            }
        }
        NodeRequest::KvEvents => return kv_events(&mut send, engine).await,
    }
    send.finish()?;
    Ok(())
}

/// Answers a call with a refusal of `kind` and ends the stream.
async fn refuse(
    mut send: quinn::SendStream,
    kind: RefusalKind,
    message: String,
) -> Result<(), FrameError> {
    write_frame(
        &mut send,
        &GenerateFrame::Refused(Refusal { kind, message }),
    )
    .await?;
    send.finish()?;
    Ok(())
}

/// Submits `request` and relays its events; a stopped stream cancels it.
async fn generate(
    send: &mut quinn::SendStream,
    engine: &Engine,
    request: GenerateRequest,
) -> Result<(), FrameError> {
    let mut stream = match engine.submit(request) {
        Ok(stream) => stream,
        Err(e) => {
            return write_frame(send, &GenerateFrame::Refused(Refusal::from(&e))).await;
        }
    };
    let id = stream.id;
    let stopped = send.stopped();
    tokio::pin!(stopped);
    // `Ok(true)` once the request's last event went out.
    let relayed = async {
        write_frame(send, &GenerateFrame::Accepted { id }).await?;
        while let Some(event) = stream.events.recv().await {
            let last = event.ends_stream();
            write_frame(send, &GenerateFrame::Event(event)).await?;
            if last {
                return Ok(true);
            }
        }
        Ok::<_, FrameError>(true)
    };
    let outcome = tokio::select! {
        outcome = relayed => outcome,
        _ = &mut stopped => Ok(false),
    };
    // A finished request is gone already; otherwise (the router stopped reading, the
    // connection died, a write failed) its blocks are freed now, not at its next token.
    if !matches!(outcome, Ok(true)) {
        let _ = engine.cancel(id);
    }
    outcome.map(|_| ())
}

/// Streams the KV events from now on, until the subscriber goes away.
async fn kv_events(send: &mut quinn::SendStream, engine: &Engine) -> Result<(), FrameError> {
    let mut events = engine.subscribe_kv_events();
    loop {
        let item = match events.recv().await {
            Ok(event) => KvFeed::Event(event),
            Err(RecvError::Lagged(missed)) => KvFeed::Lagged { missed },
            Err(RecvError::Closed) => {
                send.finish()?;
                return Ok(());
            }
        };
        write_frame(send, &item).await?;
    }
}

/// Whether an export answering `asked` can be imported by a node of layout `own`: the same
/// layout, and the blocks asked for, in order, each of the layout's size.
fn check_export(
    own: &KvLayout,
    asked: &[BlockHash],
    layout: &KvLayout,
    blocks: &[(BlockHash, Vec<u8>)],
) -> Result<(), String> {
    if layout != own {
        return Err(format!(
            "the peer's KV layout {layout:?} is not this node's {own:?}"
        ));
    }
    if blocks.len() > asked.len() || blocks.iter().zip(asked).any(|((got, _), want)| got != want) {
        return Err("the peer answered with blocks not asked for".into());
    }
    if let Some((hash, bytes)) = blocks.iter().find(|(_, b)| b.len() != own.block_bytes) {
        return Err(format!(
            "the peer sent block {hash:?} of {} bytes, the layout's blocks are {}",
            bytes.len(),
            own.block_bytes
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(backend: &str) -> KvLayout {
        KvLayout {
            backend: backend.into(),
            model_type: "qwen3".into(),
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 8,
            block_size: 4,
            block_bytes: 8,
        }
    }

    #[test]
    fn an_export_is_imported_only_in_the_same_layout_and_as_asked() {
        let own = layout("cpu f32");
        let asked = [BlockHash(1), BlockHash(2), BlockHash(3)];
        let blocks = vec![(BlockHash(1), vec![0; 8]), (BlockHash(2), vec![0; 8])];
        check_export(&own, &asked, &own, &blocks).unwrap();
        check_export(&own, &asked, &own, &[]).unwrap();
        // Canaries: each must be refused.
        let tp2 = layout("cpu f32 tp2 rank-major");
        assert!(
            check_export(&own, &asked, &tp2, &blocks)
                .unwrap_err()
                .contains("layout")
        );
        let swapped = vec![(BlockHash(2), vec![0; 8]), (BlockHash(1), vec![0; 8])];
        assert!(check_export(&own, &asked, &own, &swapped).is_err());
        let extra: Vec<_> = (1..=4).map(|h| (BlockHash(h), vec![0; 8])).collect();
        assert!(check_export(&own, &asked, &own, &extra).is_err());
        let short = vec![(BlockHash(1), vec![0; 7])];
        assert!(
            check_export(&own, &asked, &own, &short)
                .unwrap_err()
                .contains("7 bytes")
        );
    }

    /// A block payload survives the rkyv round trip; a truncated archive is refused.
    #[test]
    fn block_payloads_round_trip_and_are_validated() {
        let bytes: Vec<u8> = (0..=255).collect();
        let frame = KvBlockPayload::encode(BlockHash(u128::MAX - 7), bytes.clone()).unwrap();
        assert_eq!(
            KvBlockPayload::decode(&frame).unwrap(),
            (BlockHash(u128::MAX - 7), bytes)
        );
        assert!(KvBlockPayload::decode(&frame[..frame.len() - 3]).is_err());
    }
}
