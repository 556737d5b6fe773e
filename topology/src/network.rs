//! The raft transport.
//!
//! `LocalNetwork` connects raft nodes of one process: every RPC is encoded to JSON and decoded
//! again on the way in (so everything raft sends is proven to survive the wire encoding), then
//! handed to the target node. Nodes can be cut off and reconnected, which is how in-process
//! tests make a leader vanish. The QUIC transport between processes implements the same
//! openraft traits.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, PoisonError};

use openraft::BasicNode;
use openraft::error::{InstallSnapshotError, RPCError, RaftError, RemoteError, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::{NodeId, Raft, TypeConfig};

type RpcResult<T, E = RaftError<NodeId>> = Result<T, RPCError<NodeId, BasicNode, E>>;

/// Why a node could not be reached.
#[derive(Debug, thiserror::Error)]
enum LinkError {
    #[error("node {0} is not on this network")]
    Absent(NodeId),
    #[error("node {0} is cut off")]
    Cut(NodeId),
    #[error("message does not survive encoding: {0}")]
    Encoding(#[from] serde_json::Error),
}

#[derive(Default)]
struct Links {
    nodes: BTreeMap<NodeId, Raft>,
    cut: BTreeSet<NodeId>,
}

/// The in-process network; clone it to hand to each node's `Raft::new`.
#[derive(Clone, Default)]
pub struct LocalNetwork {
    links: Arc<Mutex<Links>>,
}

impl LocalNetwork {
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes `raft` reachable as `id`, replacing an earlier node of that id.
    pub fn attach(&self, id: NodeId, raft: Raft) {
        let mut links = self.lock();
        links.nodes.insert(id, raft);
        links.cut.remove(&id);
    }

    /// Removes node `id`: RPCs to it fail as unreachable.
    pub fn detach(&self, id: NodeId) {
        self.lock().nodes.remove(&id);
    }

    /// Cuts `id` off: nothing reaches it and nothing it sends arrives.
    pub fn cut(&self, id: NodeId) {
        self.lock().cut.insert(id);
    }

    pub fn heal(&self, id: NodeId) {
        self.lock().cut.remove(&id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Links> {
        self.links.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The target's raft handle, if `from` may talk to it.
    fn route(&self, from: NodeId, to: NodeId) -> Result<Raft, LinkError> {
        let links = self.lock();
        if links.cut.contains(&from) {
            return Err(LinkError::Cut(from));
        }
        if links.cut.contains(&to) {
            return Err(LinkError::Cut(to));
        }
        links.nodes.get(&to).cloned().ok_or(LinkError::Absent(to))
    }

    /// A factory for node `from`'s outgoing connections.
    pub fn factory(&self, from: NodeId) -> LocalNetworkFactory {
        LocalNetworkFactory {
            network: self.clone(),
            from,
        }
    }
}

/// Creates `LocalConnection`s for one node.
pub struct LocalNetworkFactory {
    network: LocalNetwork,
    from: NodeId,
}

impl RaftNetworkFactory<TypeConfig> for LocalNetworkFactory {
    type Network = LocalConnection;

    async fn new_client(&mut self, target: NodeId, _node: &BasicNode) -> LocalConnection {
        LocalConnection {
            network: self.network.clone(),
            from: self.from,
            target,
        }
    }
}

/// One node's connection to another.
pub struct LocalConnection {
    network: LocalNetwork,
    from: NodeId,
    target: NodeId,
}

/// Encodes and decodes `value`, as a wire would.
fn over_the_wire<T: Serialize + DeserializeOwned>(value: &T) -> Result<T, LinkError> {
    Ok(serde_json::from_slice(&serde_json::to_vec(value)?)?)
}

impl LocalConnection {
    async fn call<Req, Resp, E, Fut>(
        &self,
        rpc: Req,
        handle: impl FnOnce(Raft, Req) -> Fut,
    ) -> RpcResult<Resp, E>
    where
        Req: Serialize + DeserializeOwned,
        Resp: Serialize + DeserializeOwned,
        E: std::error::Error,
        Fut: Future<Output = Result<Resp, E>>,
    {
        let unreachable = |e: LinkError| RPCError::Unreachable(Unreachable::new(&e));
        let raft = self
            .network
            .route(self.from, self.target)
            .map_err(unreachable)?;
        let rpc = over_the_wire(&rpc).map_err(unreachable)?;
        let response = handle(raft, rpc)
            .await
            .map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))?;
        // A reply from a node cut off meanwhile is lost on the way back.
        self.network
            .route(self.from, self.target)
            .map_err(unreachable)?;
        over_the_wire(&response).map_err(unreachable)
    }
}

impl RaftNetwork<TypeConfig> for LocalConnection {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        _option: RPCOption,
    ) -> RpcResult<AppendEntriesResponse<NodeId>> {
        self.call(
            rpc,
            |raft, rpc| async move { raft.append_entries(rpc).await },
        )
        .await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        _option: RPCOption,
    ) -> RpcResult<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>> {
        self.call(
            rpc,
            |raft, rpc| async move { raft.install_snapshot(rpc).await },
        )
        .await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        _option: RPCOption,
    ) -> RpcResult<VoteResponse<NodeId>> {
        self.call(rpc, |raft, rpc| async move { raft.vote(rpc).await })
            .await
    }
}
