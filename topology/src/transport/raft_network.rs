//! openraft's network over QUIC: each RPC is one stream on a pooled connection to the target,
//! bounded by the deadline openraft gives it.

use openraft::BasicNode;
use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};

use super::client::{Client, ClientError};
use super::wire::{Request, Response};
use crate::{NodeId, TypeConfig};

type RpcResult<T, E = RaftError<NodeId>> = Result<T, RPCError<NodeId, BasicNode, E>>;

/// Creates one member's connections to the others.
#[derive(Clone)]
pub struct QuicNetworkFactory {
    client: Client,
}

impl QuicNetworkFactory {
    pub fn new(client: Client) -> Self {
        Self { client }
    }
}

impl RaftNetworkFactory<TypeConfig> for QuicNetworkFactory {
    type Network = QuicConnection;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> QuicConnection {
        QuicConnection {
            client: self.client.clone(),
            target,
            addr: node.addr.clone(),
        }
    }
}

/// A member's link to one target.
pub struct QuicConnection {
    client: Client,
    target: NodeId,
    addr: String,
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Unexpected(String);

impl QuicConnection {
    async fn call<E: std::error::Error>(
        &self,
        request: Request,
        option: &RPCOption,
    ) -> RpcResult<Response, E> {
        let call = self
            .client
            .call_member(&self.addr, Some(self.target), &request);
        let response = tokio::time::timeout(option.hard_ttl(), call)
            .await
            .map_err(|_| {
                RPCError::Unreachable(Unreachable::new(&Unexpected(format!(
                    "no answer from member {} within {:?}",
                    self.target,
                    option.hard_ttl()
                ))))
            })?;
        response.map_err(|e| match e {
            e @ ClientError::Resolve { .. } | e @ ClientError::Connect { .. } => {
                RPCError::Unreachable(Unreachable::new(&e))
            }
            e => RPCError::Network(NetworkError::new(&e)),
        })
    }

    fn unexpected<E: std::error::Error>(
        &self,
        response: Response,
    ) -> RPCError<NodeId, BasicNode, E> {
        let what: String = format!("{response:?}").chars().take(200).collect();
        RPCError::Network(NetworkError::new(&Unexpected(format!(
            "member {} answered a raft RPC with {what}",
            self.target
        ))))
    }
}

impl RaftNetwork<TypeConfig> for QuicConnection {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<AppendEntriesResponse<NodeId>> {
        match self.call(Request::AppendEntries(rpc), &option).await? {
            Response::AppendEntries(result) => {
                result.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
            }
            other => Err(self.unexpected(other)),
        }
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>> {
        match self.call(Request::InstallSnapshot(rpc), &option).await? {
            Response::InstallSnapshot(result) => {
                result.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
            }
            other => Err(self.unexpected(other)),
        }
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> RpcResult<VoteResponse<NodeId>> {
        match self.call(Request::Vote(rpc), &option).await? {
            Response::Vote(result) => {
                result.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
            }
            other => Err(self.unexpected(other)),
        }
    }
}
