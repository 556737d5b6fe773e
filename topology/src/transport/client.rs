//! The calling side: a pool of connections to members, one bidirectional stream per call.
//!
//! Used by members for raft RPCs (through `raft_network.rs`), by the member that admits
//! joiners, and by operators' tools. A follower answers writes and reads with the leader's
//! address, and the calls here follow it a bounded number of times.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use openraft::LogId;
use openraft::error::{ClientWriteError, RaftError};

use super::ca::{Principal, SERVER_NAME, Validity};
use super::wire::{
    ClusterView, FeedItem, FrameError, MembershipChange, Refusal, Request, Response, read_frame,
    write_frame,
};
use crate::state::{Command, Outcome};
use crate::{NodeId, Raft};

/// How many leader redirects a call follows before giving up.
const MAX_REDIRECTS: usize = 3;
/// How often a call waiting for the group to name a leader asks again.
const ELECTION_POLL: Duration = Duration::from_millis(100);

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot resolve {addr}: {detail}")]
    Resolve { addr: String, detail: String },
    #[error("cannot connect to {addr}: {detail}")]
    Connect { addr: String, detail: String },
    #[error("{addr}: {source}")]
    Frame { addr: String, source: FrameError },
    #[error("{addr} refused: {refusal}")]
    Refused { addr: String, refusal: Refusal },
    #[error("{addr} answered with an unexpected message: {what}")]
    Unexpected { addr: String, what: String },
    #[error("{addr} closed the stream without an answer")]
    NoAnswer { addr: String },
    #[error("{addr} did not answer within {0:?}", timeout)]
    Timeout { addr: String, timeout: Duration },
    #[error("the member at {addr} presents a certificate of member {found:?}, expected {expected}")]
    WrongMember {
        addr: String,
        expected: NodeId,
        found: Option<NodeId>,
    },
}

impl ClientError {
    /// Whether the request may have reached the member (it failed after being sent).
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self,
            ClientError::Resolve { .. } | ClientError::Connect { .. } | ClientError::Timeout { .. }
        )
    }
}

/// Connections to members, opened on first use and replaced once closed.
#[derive(Clone)]
pub struct Client {
    endpoint: quinn::Endpoint,
    connections: Arc<Mutex<HashMap<SocketAddr, quinn::Connection>>>,
    timeout: Duration,
    /// How long a call refused with no leader's address waits for one (0: it returns the
    /// refusal at once).
    election_wait: Duration,
}

impl Client {
    /// Calls go out through `endpoint` with its default client configuration; each one must
    /// complete (connect, send, answer) within `timeout`.
    pub fn new(endpoint: quinn::Endpoint, timeout: Duration) -> Self {
        Self {
            endpoint,
            connections: Arc::default(),
            timeout,
            election_wait: Duration::ZERO,
        }
    }

    /// This client with calls refused for want of a known leader (an election under way, or a
    /// leader that has just left the group) asking again for up to `wait` before answering
    /// with the refusal: what an operator's command wants, not a client that tries another
    /// member itself. The request was not taken, so asking again is safe.
    pub fn waiting_for_elections(mut self, wait: Duration) -> Self {
        self.election_wait = wait;
        self
    }

    /// Forgets the open connections (every clone of this client): calls under way finish on
    /// theirs, which close once unused, and the next call to each member opens a new one —
    /// presenting a renewed certificate.
    pub fn forget_all(&self) {
        self.pool().clear();
    }

    pub fn endpoint(&self) -> &quinn::Endpoint {
        &self.endpoint
    }

    fn pool(&self) -> std::sync::MutexGuard<'_, HashMap<SocketAddr, quinn::Connection>> {
        self.connections
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    async fn resolve(addr: &str) -> Result<SocketAddr, ClientError> {
        let resolve_err = |detail: String| ClientError::Resolve {
            addr: addr.to_string(),
            detail,
        };
        tokio::net::lookup_host(addr)
            .await
            .map_err(|e| resolve_err(e.to_string()))?
            .next()
            .ok_or_else(|| resolve_err("no address".into()))
    }

    /// An open connection to `addr`, and the member id its certificate names.
    pub async fn connection(&self, addr: &str) -> Result<quinn::Connection, ClientError> {
        let socket = Self::resolve(addr).await?;
        if let Some(connection) = self.pool().get(&socket)
            && connection.close_reason().is_none()
        {
            return Ok(connection.clone());
        }
        let connect_err = |detail: String| ClientError::Connect {
            addr: addr.to_string(),
            detail,
        };
        let connection = self
            .endpoint
            .connect(socket, SERVER_NAME)
            .map_err(|e| connect_err(e.to_string()))?
            .await
            .map_err(|e| connect_err(e.to_string()))?;
        self.pool().insert(socket, connection.clone());
        Ok(connection)
    }

    fn forget(&self, connection: &quinn::Connection) {
        let mut pool = self.pool();
        if pool
            .get(&connection.remote_address())
            .is_some_and(|c| c.stable_id() == connection.stable_id())
        {
            pool.remove(&connection.remote_address());
        }
    }

    /// One request, one response, within the client's timeout.
    pub async fn call(&self, addr: &str, request: &Request) -> Result<Response, ClientError> {
        self.call_member(addr, None, request).await
    }

    /// Like [`call`](Self::call), and refuses to talk to a member other than `expected`.
    pub async fn call_member(
        &self,
        addr: &str,
        expected: Option<NodeId>,
        request: &Request,
    ) -> Result<Response, ClientError> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let timed_out = || ClientError::Timeout {
            addr: addr.to_string(),
            timeout: self.timeout,
        };
        let connection = tokio::time::timeout_at(deadline, self.connection(addr))
            .await
            .map_err(|_| timed_out())??;
        if let Some(expected) = expected {
            let found = peer_member(&connection);
            if found != Some(expected) {
                return Err(ClientError::WrongMember {
                    addr: addr.to_string(),
                    expected,
                    found,
                });
            }
        }
        let result = tokio::time::timeout_at(deadline, exchange(&connection, addr, request))
            .await
            .map_err(|_| timed_out())
            .and_then(|answer| answer);
        // A failed or unanswered call may mean a dead peer: dial afresh next time rather than
        // wait for the idle timeout to close this connection. So does a refusal of the
        // certificate this connection was opened with, past its end: a new one presents the
        // renewed certificate.
        if matches!(&result, Err(_) | Ok(Response::Refused(Refusal::Expired(_)))) {
            self.forget(&connection);
        }
        result
    }

    /// Calls `addr`, following `NotLeader` answers to the leader.
    async fn call_leader(
        &self,
        addr: &str,
        request: &Request,
    ) -> Result<(String, Response), ClientError> {
        let mut addr = addr.to_string();
        let mut redirects = 0;
        // A refusal naming no leader's address is waited out for `election_wait`.
        let elected_by = tokio::time::Instant::now() + self.election_wait;
        loop {
            match self.call(&addr, request).await? {
                Response::Refused(Refusal::NotLeader {
                    addr: Some(leader), ..
                }) if leader != addr && redirects < MAX_REDIRECTS => {
                    addr = leader;
                    redirects += 1;
                }
                Response::Refused(Refusal::NotLeader { addr: None, .. })
                    if tokio::time::Instant::now() < elected_by =>
                {
                    tokio::time::sleep(ELECTION_POLL).await;
                }
                response => return Ok((addr, response)),
            }
        }
    }

    /// Commits `command` through the leader; returns its log id and outcome.
    pub async fn propose(
        &self,
        addr: &str,
        command: Command,
    ) -> Result<(LogId<NodeId>, Outcome), ClientError> {
        match self.call_leader(addr, &Request::Propose(command)).await? {
            (_, Response::Proposed { log_id, outcome }) => Ok((log_id, outcome)),
            (addr, other) => Err(unexpected(&addr, other)),
        }
    }

    /// A linearizable read through the leader.
    pub async fn read(&self, addr: &str) -> Result<ClusterView, ClientError> {
        match self.call_leader(addr, &Request::Read).await? {
            (_, Response::View(view)) => Ok(*view),
            (addr, other) => Err(unexpected(&addr, other)),
        }
    }

    pub async fn add_learner(
        &self,
        addr: &str,
        id: NodeId,
        learner_addr: &str,
    ) -> Result<LogId<NodeId>, ClientError> {
        let request = Request::AddLearner {
            id,
            addr: learner_addr.to_string(),
        };
        membership_changed(self.call_leader(addr, &request).await?)
    }

    pub async fn change_membership(
        &self,
        addr: &str,
        change: MembershipChange,
    ) -> Result<LogId<NodeId>, ClientError> {
        let request = Request::ChangeMembership(change);
        membership_changed(self.call_leader(addr, &request).await?)
    }

    /// Subscribes to `addr`'s change feed (any member serves it, from its applied state).
    pub async fn subscribe(&self, addr: &str) -> Result<Subscription, ClientError> {
        let opened = async {
            let connection = self.connection(addr).await?;
            let frame_err = |source: FrameError| ClientError::Frame {
                addr: addr.to_string(),
                source,
            };
            let (mut send, recv) =
                connection
                    .open_bi()
                    .await
                    .map_err(|e| ClientError::Connect {
                        addr: addr.to_string(),
                        detail: e.to_string(),
                    })?;
            write_frame(&mut send, &Request::Subscribe)
                .await
                .map_err(frame_err)?;
            send.finish().map_err(|e| frame_err(e.into()))?;
            Ok(Subscription {
                addr: addr.to_string(),
                recv,
            })
        };
        tokio::time::timeout(self.timeout, opened)
            .await
            .map_err(|_| ClientError::Timeout {
                addr: addr.to_string(),
                timeout: self.timeout,
            })?
    }
}

/// Commits `command` through the local raft node if it leads, else through the leader it
/// names, over `client`.
pub async fn commit_via_leader(
    raft: &Raft,
    client: &Client,
    command: Command,
) -> Result<Outcome, Refusal> {
    match raft.client_write(command.clone()).await {
        Ok(written) => Ok(written.data),
        Err(RaftError::APIError(ClientWriteError::ForwardToLeader(forward))) => {
            let addr = forward
                .leader_node
                .map(|n| n.addr)
                .ok_or(Refusal::NotLeader {
                    leader: forward.leader_id,
                    addr: None,
                })?;
            client
                .propose(&addr, command)
                .await
                .map(|(_, outcome)| outcome)
                .map_err(|e| Refusal::Failed(e.to_string()))
        }
        Err(e) => Err(Refusal::Failed(e.to_string())),
    }
}

/// The member id the peer's certificate names.
pub fn peer_member(connection: &quinn::Connection) -> Option<NodeId> {
    match peer_principal(connection)? {
        Principal::Member(id) => Some(id),
        Principal::Operator(_) => None,
    }
}

/// Who the peer's certificate speaks for: a member or an operator.
pub fn peer_principal(connection: &quinn::Connection) -> Option<Principal> {
    Principal::of(&peer_leaf(connection)?)
}

/// When the certificate the peer presented on `connection` stops being valid.
pub fn peer_expiry(connection: &quinn::Connection) -> Option<std::time::SystemTime> {
    Validity::of(&peer_leaf(connection)?)
        .ok()
        .map(|v| v.not_after)
}

fn peer_leaf(connection: &quinn::Connection) -> Option<rustls::pki_types::CertificateDer<'static>> {
    let chain = connection
        .peer_identity()?
        .downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>()
        .ok()?;
    chain.first().cloned()
}

async fn exchange(
    connection: &quinn::Connection,
    addr: &str,
    request: &Request,
) -> Result<Response, ClientError> {
    let frame_err = |source: FrameError| ClientError::Frame {
        addr: addr.to_string(),
        source,
    };
    let (mut send, mut recv) = connection
        .open_bi()
        .await
        .map_err(|e| ClientError::Connect {
            addr: addr.to_string(),
            detail: e.to_string(),
        })?;
    write_frame(&mut send, request).await.map_err(frame_err)?;
    send.finish().map_err(|e| frame_err(e.into()))?;
    read_frame(&mut recv)
        .await
        .map_err(frame_err)?
        .ok_or_else(|| ClientError::NoAnswer {
            addr: addr.to_string(),
        })
}

fn unexpected(addr: &str, response: Response) -> ClientError {
    match response {
        Response::Refused(refusal) => ClientError::Refused {
            addr: addr.to_string(),
            refusal,
        },
        other => ClientError::Unexpected {
            addr: addr.to_string(),
            what: format!("{other:?}").chars().take(200).collect(),
        },
    }
}

fn membership_changed((addr, response): (String, Response)) -> Result<LogId<NodeId>, ClientError> {
    match response {
        Response::MembershipChanged { log_id } => Ok(log_id),
        other => Err(unexpected(&addr, other)),
    }
}

/// A stream of committed changes from one member.
pub struct Subscription {
    addr: String,
    recv: quinn::RecvStream,
}

impl Subscription {
    /// The next item; `Ok(None)` when the member ended the feed.
    pub async fn next(&mut self) -> Result<Option<FeedItem>, ClientError> {
        let frame = read_frame::<Response>(&mut self.recv)
            .await
            .map_err(|source| ClientError::Frame {
                addr: self.addr.clone(),
                source,
            })?;
        match frame {
            None => Ok(None),
            Some(Response::Feed(item)) => Ok(Some(item)),
            Some(other) => Err(unexpected(&self.addr, other)),
        }
    }
}
