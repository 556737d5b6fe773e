//! The router side: one QUIC connection to a node, a stream per call.

use std::net::SocketAddr;

use serde::de::DeserializeOwned;
use strata_protocol::{GenerateRequest, TokenEvent};
use strata_quic::{FrameError, read_frame, read_frame_bytes, write_frame};

use super::wire::{
    GenerateCall, GenerateFrame, KvBlockPayload, KvExportHead, KvFeed, KvFetch, NodeInfo,
    NodeRequest, PinReport, Refusal,
};
use crate::kv::{BlockHash, KvDump, KvLayout};
use crate::load::EngineLoad;

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("cannot reach node {addr}: {detail}")]
    Connect { addr: SocketAddr, detail: String },
    #[error("node {addr}: connection lost: {source}")]
    Connection {
        addr: SocketAddr,
        source: quinn::ConnectionError,
    },
    #[error("node {addr}: {source}")]
    Frame {
        addr: SocketAddr,
        source: FrameError,
    },
    #[error("node {addr} ended the call without an answer")]
    Ended { addr: SocketAddr },
    #[error("node {addr} answered out of turn: {what}")]
    Protocol { addr: SocketAddr, what: String },
    #[error(transparent)]
    Refused(Refusal),
}

/// A connection to one node.
#[derive(Clone)]
pub struct NodeClient {
    connection: quinn::Connection,
    addr: SocketAddr,
}

impl NodeClient {
    /// Dials `addr` from `endpoint` (whose client configuration carries this caller's
    /// certificate), verifying the node's certificate for `server_name`.
    pub async fn connect(
        endpoint: &quinn::Endpoint,
        addr: SocketAddr,
        server_name: &str,
    ) -> Result<Self, NodeError> {
        let connect = |detail: String| NodeError::Connect { addr, detail };
        let connecting = endpoint
            .connect(addr, server_name)
            .map_err(|e| connect(e.to_string()))?;
        let connection = connecting.await.map_err(|e| connect(e.to_string()))?;
        Ok(Self { connection, addr })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether the connection has ended (the node died, or closed it).
    pub fn is_closed(&self) -> bool {
        self.connection.close_reason().is_some()
    }

    /// Resolves when the connection ends.
    pub async fn closed(&self) {
        self.connection.closed().await;
    }

    /// Submits `request`; its events follow on the returned stream. Dropping the stream (or
    /// [`RemoteStream::cancel`]) cancels the request on the node.
    pub async fn generate(&self, request: GenerateRequest) -> Result<RemoteStream, NodeError> {
        self.generate_with(request, None).await
    }

    /// [`NodeClient::generate`], the node first importing the prompt blocks `fetch` names from
    /// the peer that holds them.
    pub async fn generate_with(
        &self,
        request: GenerateRequest,
        fetch: Option<KvFetch>,
    ) -> Result<RemoteStream, NodeError> {
        let call = GenerateCall { request, fetch };
        let mut recv = self.call(&NodeRequest::Generate(Box::new(call))).await?;
        match self.frame(&mut recv).await? {
            GenerateFrame::Accepted { id } => Ok(RemoteStream {
                id,
                recv,
                addr: self.addr,
                done: false,
            }),
            GenerateFrame::Refused(refusal) => Err(NodeError::Refused(refusal)),
            GenerateFrame::Event(_) => Err(self.protocol("an event before the acceptance")),
        }
    }

    pub async fn load(&self) -> Result<EngineLoad, NodeError> {
        let mut recv = self.call(&NodeRequest::Load).await?;
        self.frame(&mut recv).await
    }

    pub async fn info(&self) -> Result<NodeInfo, NodeError> {
        let mut recv = self.call(&NodeRequest::Info).await?;
        self.frame(&mut recv).await
    }

    /// Pins the leading run of `hashes` the node has cached under `name` for `ttl_ms`.
    pub async fn pin(
        &self,
        name: String,
        hashes: Vec<BlockHash>,
        ttl_ms: u64,
    ) -> Result<Result<PinReport, String>, NodeError> {
        let call = NodeRequest::Pin {
            name,
            hashes,
            ttl_ms,
        };
        let mut recv = self.call(&call).await?;
        self.frame(&mut recv).await
    }

    /// Drops the pin `name`; whether the node held it.
    pub async fn unpin(&self, name: String) -> Result<bool, NodeError> {
        let mut recv = self.call(&NodeRequest::Unpin { name }).await?;
        self.frame(&mut recv).await
    }

    /// The node's pins.
    pub async fn pins(&self) -> Result<Vec<PinReport>, NodeError> {
        let mut recv = self.call(&NodeRequest::Pins).await?;
        self.frame(&mut recv).await
    }

    pub async fn kv_dump(&self) -> Result<KvDump, NodeError> {
        let mut recv = self.call(&NodeRequest::KvDump).await?;
        self.frame(&mut recv).await
    }

    /// The bytes of the leading run of `hashes` the node has cached, in its layout.
    pub async fn kv_export(
        &self,
        hashes: Vec<BlockHash>,
    ) -> Result<(KvLayout, Vec<(BlockHash, Vec<u8>)>), NodeError> {
        let addr = self.addr;
        let mut recv = self.call(&NodeRequest::KvExport { hashes }).await?;
        let head: KvExportHead = self.frame(&mut recv).await?;
        let mut blocks = Vec::with_capacity(head.blocks as usize);
        for _ in 0..head.blocks {
            let frame = read_frame_bytes(&mut recv)
                .await
                .map_err(|source| NodeError::Frame { addr, source })?
                .ok_or(NodeError::Ended { addr })?;
            let block = KvBlockPayload::decode(&frame).map_err(|e| {
                self.protocol(&format!("a KV block payload that does not decode: {e}"))
            })?;
            blocks.push(block);
        }
        Ok((head.layout, blocks))
    }

    /// The node's KV events from now on.
    pub async fn kv_events(&self) -> Result<KvSubscription, NodeError> {
        let recv = self.call(&NodeRequest::KvEvents).await?;
        Ok(KvSubscription {
            recv,
            addr: self.addr,
        })
    }

    async fn call(&self, request: &NodeRequest) -> Result<quinn::RecvStream, NodeError> {
        let addr = self.addr;
        let (mut send, recv) = self
            .connection
            .open_bi()
            .await
            .map_err(|source| NodeError::Connection { addr, source })?;
        write_frame(&mut send, request)
            .await
            .map_err(|source| NodeError::Frame { addr, source })?;
        send.finish().map_err(|e| NodeError::Frame {
            addr,
            source: e.into(),
        })?;
        Ok(recv)
    }

    async fn frame<T: DeserializeOwned>(
        &self,
        recv: &mut quinn::RecvStream,
    ) -> Result<T, NodeError> {
        next_frame(recv, self.addr)
            .await?
            .ok_or(NodeError::Ended { addr: self.addr })
    }

    fn protocol(&self, what: &str) -> NodeError {
        NodeError::Protocol {
            addr: self.addr,
            what: what.to_string(),
        }
    }
}

async fn next_frame<T: DeserializeOwned>(
    recv: &mut quinn::RecvStream,
    addr: SocketAddr,
) -> Result<Option<T>, NodeError> {
    read_frame(recv)
        .await
        .map_err(|source| NodeError::Frame { addr, source })
}

/// The events of a request running on a node.
pub struct RemoteStream {
    /// The node's id for the request.
    pub id: u64,
    recv: quinn::RecvStream,
    addr: SocketAddr,
    done: bool,
}

impl RemoteStream {
    /// The next event; `None` after `Finished` or `Failed`. An error means the node or the
    /// connection went away mid-stream: the request may be continued elsewhere.
    pub async fn next(&mut self) -> Result<Option<TokenEvent>, NodeError> {
        if self.done {
            return Ok(None);
        }
        match next_frame::<GenerateFrame>(&mut self.recv, self.addr).await? {
            Some(GenerateFrame::Event(event)) => {
                self.done = event.ends_stream();
                Ok(Some(event))
            }
            Some(_) => Err(NodeError::Protocol {
                addr: self.addr,
                what: "a second acceptance".into(),
            }),
            None => Err(NodeError::Ended { addr: self.addr }),
        }
    }

    /// Stops the request on the node.
    pub fn cancel(mut self) {
        let _ = self.recv.stop(quinn::VarInt::from_u32(0));
    }
}

/// A node's KV event feed.
pub struct KvSubscription {
    recv: quinn::RecvStream,
    addr: SocketAddr,
}

impl KvSubscription {
    /// The next item; `None` when the node ended the feed.
    pub async fn next(&mut self) -> Result<Option<KvFeed>, NodeError> {
        next_frame(&mut self.recv, self.addr).await
    }
}
