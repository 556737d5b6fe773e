//! The node side: accepts routers' connections, one call per stream.

use std::sync::Arc;

use strata_protocol::TokenEvent;
use strata_quic::{FrameError, read_frame, write_frame};
use tokio::sync::broadcast::error::RecvError;

use super::wire::{GenerateFrame, KvFeed, NodeInfo, NodeRequest, Refusal, RefusalKind};
use crate::Engine;

/// The engine a node serves, and what it says about itself.
pub struct NodeService {
    engine: Arc<Engine>,
    info: NodeInfo,
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
        };
        Self { engine, info }
    }

    pub fn info(&self) -> &NodeInfo {
        &self.info
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

async fn serve_connection(connection: quinn::Connection, service: Arc<NodeService>) {
    let peer = connection.remote_address();
    loop {
        match connection.accept_bi().await {
            Ok((send, recv)) => {
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
            let refusal = Refusal {
                kind: RefusalKind::Unavailable,
                message: format!("malformed call: {e}"),
            };
            write_frame(&mut send, &GenerateFrame::Refused(refusal)).await?;
            send.finish()?;
            return Ok(());
        }
    };
    let engine = &service.engine;
    match request {
        NodeRequest::Generate(request) => generate(&mut send, engine, *request).await?,
        NodeRequest::Load => write_frame(&mut send, &engine.load()).await?,
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

/// Submits `request` and relays its events; a stopped stream cancels it.
async fn generate(
    send: &mut quinn::SendStream,
    engine: &Engine,
    request: strata_protocol::GenerateRequest,
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
            let last = !matches!(event, TokenEvent::Token { .. });
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
