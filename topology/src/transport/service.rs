//! The member side of the endpoint: accepts connections, reads one request per stream and
//! answers it from the local raft node.
//!
//! Nothing a peer sends can take the member down: a frame that is too large, does not decode
//! or names an unknown message type is answered with `Refused` and logged with the peer's
//! address, and the connection keeps serving its other streams. Raft RPCs are accepted only
//! from the member their certificate names; an operator's certificate may make every client
//! call (propose, read, subscribe, membership changes) but no raft RPC, and membership
//! changes are logged with who asked.
//!
//! Every stream is served by its own task, and its request must arrive whole within the
//! service's read timeout: a peer that sends part of a frame and stalls is answered with
//! `Refused` and its stream ended, so it holds a task and a buffer for that long at most.
//! A connection that sends nothing at all is closed by QUIC's idle timeout.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use openraft::error::{ClientWriteError, RaftError};
use openraft::raft::AppendEntriesResponse;
use openraft::{BasicNode, ChangeMembers, RaftMetrics, ServerState};

use super::ca::Principal;
use super::client::{peer_expiry, peer_principal};
use super::join::JoinAuthority;
use super::raft_guard;
use super::wire::{
    ClusterView, FeedItem, FrameError, MembershipChange, Refusal, Request, Response, node,
    read_frame_bytes, write_frame,
};
use crate::election::{LeaderContact, grants_pre_vote};
use crate::store::{FeedError, StateReader};
use crate::{NodeId, Raft};

/// What a member serves.
#[derive(Clone)]
pub struct Service {
    pub raft: Raft,
    pub state: StateReader,
    /// Set on members that hold the CA key and may admit joiners.
    pub join: Option<Arc<JoinAuthority>>,
    /// How long a peer may take to send a whole request once its stream is open.
    pub read_timeout: Duration,
    /// When this member last heard from a leader, for pre-votes (`crate::election`).
    pub contact: Arc<LeaderContact>,
    /// How long a voter must not have heard from a leader before it grants a pre-vote: the
    /// leader lease.
    pub lease: Duration,
}

/// Accepts connections on `endpoint` until it is closed. `mutual` says whether the endpoint
/// authenticates clients (the member endpoint) or not (the join endpoint, which serves only
/// `Join`).
pub async fn serve(endpoint: quinn::Endpoint, service: Service, mutual: bool) {
    while let Some(incoming) = endpoint.accept().await {
        let service = service.clone();
        tokio::spawn(async move {
            let remote = incoming.remote_address();
            match incoming.await {
                Ok(connection) => serve_connection(connection, service, mutual).await,
                Err(e) => log_failed_handshake(remote, &e),
            }
        });
    }
}

async fn serve_connection(connection: quinn::Connection, service: Service, mutual: bool) {
    let remote = connection.remote_address();
    let peer = peer_principal(&connection).map(Arc::new);
    let expires = peer_expiry(&connection);
    if mutual && peer.is_none() {
        // The CA issued a certificate naming neither a member nor an operator: not one of
        // ours to trust.
        tracing::warn!(peer = %remote, "peer certificate names no member or operator; closing");
        connection.close(1u32.into(), b"certificate names no member or operator");
        return;
    }
    loop {
        match connection.accept_bi().await {
            Ok((send, recv)) => {
                let service = service.clone();
                let peer = peer.clone();
                tokio::spawn(async move {
                    let peer = Peer {
                        principal: peer.as_deref(),
                        expires,
                    };
                    serve_stream(send, recv, &service, peer, remote, mutual).await;
                });
            }
            Err(e) => {
                tracing::debug!(peer = %remote, error = %e, "connection ended");
                return;
            }
        }
    }
}

/// Who called, as the connection's certificate says.
#[derive(Clone, Copy)]
struct Peer<'a> {
    principal: Option<&'a Principal>,
    /// When that certificate stops being valid.
    expires: Option<SystemTime>,
}

async fn serve_stream(
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    service: &Service,
    caller: Peer<'_>,
    remote: SocketAddr,
    mutual: bool,
) {
    let peer = caller.principal;
    let read = tokio::time::timeout(service.read_timeout, read_frame_bytes(&mut recv)).await;
    let refused = match read {
        Err(_elapsed) => read_timeout_refusal(service.read_timeout),
        Ok(Ok(Some(body))) => match serde_json::from_slice::<Request>(&body) {
            Ok(request) => match admit(&request, peer, mutual).and_then(|()| {
                // Checked per request: a certificate revoked, or past its end, while its
                // connection is open stops working at its next call.
                not_revoked(&service.state, peer)?;
                not_expired(caller)?;
                raft_guard::well_formed(&request)?;
                match peer {
                    Some(Principal::Member(id)) => {
                        raft_guard::from_a_member(&request, *id, &group_members(service))
                    }
                    _ => Ok(()),
                }
            }) {
                Ok(()) => {
                    if let Err(e) = answer(request, &mut send, service, peer).await {
                        tracing::debug!(peer = %remote, error = %e, "answer not delivered");
                    }
                    let _ = send.finish();
                    return;
                }
                Err(refusal) => refusal,
            },
            Err(e) => Refusal::Malformed(e.to_string()),
        },
        Ok(Ok(None)) => Refusal::Malformed("the stream ended before a request".into()),
        Ok(Err(FrameError::Oversize(len))) => Refusal::Oversize(len),
        Ok(Err(e)) => Refusal::Malformed(e.to_string()),
    };
    tracing::warn!(
        peer = %remote,
        principal = %describe(peer),
        refusal = %refused,
        "refused a request"
    );
    // Whatever else the peer sends on this stream is not read.
    let _ = recv.stop(0u32.into());
    // A peer that does not read its answer either gets the stream reset instead.
    let refusal = Response::Refused(refused);
    match tokio::time::timeout(service.read_timeout, write_frame(&mut send, &refusal)).await {
        Ok(_) => {
            let _ = send.finish();
        }
        Err(_) => {
            let _ = send.reset(0u32.into());
        }
    }
}

/// Every member of the group's effective membership: voters and learners of each configuration
/// in force.
fn group_members(service: &Service) -> BTreeSet<NodeId> {
    let metrics = service.raft.metrics();
    let metrics = metrics.borrow();
    metrics
        .membership_config
        .membership()
        .nodes()
        .map(|(id, _)| *id)
        .collect()
}

/// Who a request came from, for the log.
fn describe(peer: Option<&Principal>) -> String {
    peer.map_or_else(|| "unauthenticated".to_string(), ToString::to_string)
}

fn read_timeout_refusal(timeout: Duration) -> Refusal {
    Refusal::ReadTimeout {
        ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
    }
}

/// A handshake this member refused (a TLS failure: no certificate, another CA) or that the
/// peer refused is a warning; one the peer abandoned (it gave up, or timed out) is not.
fn log_failed_handshake(remote: SocketAddr, e: &quinn::ConnectionError) {
    match e {
        quinn::ConnectionError::TransportError(_) | quinn::ConnectionError::ConnectionClosed(_) => {
            tracing::warn!(peer = %remote, error = %e, "refused a connection at the handshake");
        }
        _ => tracing::debug!(peer = %remote, error = %e, "handshake abandoned"),
    }
}

/// Whether this peer may make this request.
fn admit(request: &Request, peer: Option<&Principal>, mutual: bool) -> Result<(), Refusal> {
    if !mutual {
        return match request {
            Request::Join(_) => Ok(()),
            _ => Err(Refusal::Failed(
                "this endpoint serves only joins; use the member endpoint".into(),
            )),
        };
    }
    if !request.is_raft() {
        return Ok(());
    }
    match peer {
        Some(Principal::Member(peer)) => match request.raft_sender() {
            Some(claimed) if claimed != *peer => Err(Refusal::WrongSender {
                claimed,
                peer: *peer,
            }),
            _ => Ok(()),
        },
        Some(Principal::Operator(name)) => Err(Refusal::OperatorRaft {
            operator: name.clone(),
        }),
        // The member endpoint closes such connections before reading a request.
        None => Err(Refusal::Failed(
            "raft RPCs need a member certificate".into(),
        )),
    }
}

/// Refuses a peer whose certificate the group has revoked (a member that left, an operator
/// withdrawn by name), raft calls included: a removed member can neither write, read, mint join
/// tokens nor disturb elections with its votes.
fn not_revoked(state: &StateReader, peer: Option<&Principal>) -> Result<(), Refusal> {
    let revoked = state.with(|applied| {
        let list = applied.cluster.revoked();
        match peer {
            Some(Principal::Member(id)) => list.members.contains(id),
            Some(Principal::Operator(name)) => list.operators.contains(name),
            None => false,
        }
    });
    match (revoked, peer) {
        (true, Some(principal)) => Err(Refusal::Revoked(principal.to_string())),
        _ => Ok(()),
    }
}

/// Refuses a peer whose certificate has passed its end: the handshake checks it, and a
/// connection that outlives it is refused from then on (its holder failed to renew).
fn not_expired(caller: Peer<'_>) -> Result<(), Refusal> {
    match (caller.expires, caller.principal) {
        (Some(end), Some(principal)) if SystemTime::now() > end => {
            Err(Refusal::Expired(principal.to_string()))
        }
        _ => Ok(()),
    }
}

/// Turns a raft API error into a refusal, naming the leader where raft knows it.
fn refusal<E>(e: RaftError<NodeId, E>) -> Refusal
where
    E: std::error::Error + TryAsForward,
{
    match e {
        RaftError::APIError(api) => match api.forward() {
            Some((leader, addr)) => Refusal::NotLeader { leader, addr },
            None => Refusal::Failed(api.to_string()),
        },
        RaftError::Fatal(fatal) => Refusal::Failed(fatal.to_string()),
    }
}

/// The API errors that can mean "ask the leader instead".
trait TryAsForward {
    fn forward(&self) -> Option<(Option<NodeId>, Option<String>)>;
}

impl TryAsForward for ClientWriteError<NodeId, openraft::BasicNode> {
    fn forward(&self) -> Option<(Option<NodeId>, Option<String>)> {
        match self {
            ClientWriteError::ForwardToLeader(f) => {
                Some((f.leader_id, f.leader_node.as_ref().map(|n| n.addr.clone())))
            }
            ClientWriteError::ChangeMembershipError(_) => None,
        }
    }
}

impl TryAsForward for openraft::error::CheckIsLeaderError<NodeId, openraft::BasicNode> {
    fn forward(&self) -> Option<(Option<NodeId>, Option<String>)> {
        match self {
            openraft::error::CheckIsLeaderError::ForwardToLeader(f) => {
                Some((f.leader_id, f.leader_node.as_ref().map(|n| n.addr.clone())))
            }
            openraft::error::CheckIsLeaderError::QuorumNotEnough(_) => None,
        }
    }
}

async fn answer(
    request: Request,
    send: &mut quinn::SendStream,
    service: &Service,
    peer: Option<&Principal>,
) -> Result<(), FrameError> {
    let raft = &service.raft;
    let response = match request {
        Request::AppendEntries(rpc) => {
            let answer = raft.append_entries(rpc).await;
            if matches!(&answer, Ok(a) if !matches!(a, AppendEntriesResponse::HigherVote(_))) {
                service.contact.heard();
            }
            Response::AppendEntries(answer)
        }
        Request::Vote(rpc) => {
            let answer = raft.vote(rpc).await;
            if matches!(&answer, Ok(vote) if vote.vote_granted) {
                service.contact.heard();
            }
            Response::Vote(answer)
        }
        Request::InstallSnapshot(rpc) => {
            let answer = raft.install_snapshot(rpc).await;
            if answer.is_ok() {
                service.contact.heard();
            }
            Response::InstallSnapshot(answer)
        }
        Request::PreVote { term, last_applied } => {
            let granted = grants_pre_vote(raft, &service.contact, service.lease, last_applied);
            tracing::debug!(by = %describe(peer), term, granted, "pre-vote");
            Response::PreVote { granted }
        }
        Request::Propose(_) | Request::AddLearner { .. } | Request::ChangeMembership(_)
            if let Err(refused) = leads(service) =>
        {
            Response::Refused(refused)
        }
        Request::Propose(command) => match raft.client_write(command).await {
            Ok(written) => Response::Proposed {
                log_id: written.log_id,
                outcome: written.data,
            },
            Err(e) => Response::Refused(refusal(e)),
        },
        Request::Read if let Err(refused) = leader_heard(service) => Response::Refused(refused),
        Request::Read => match raft.ensure_linearizable().await {
            Ok(_) => Response::View(Box::new(view(service))),
            Err(e) => Response::Refused(refusal(e)),
        },
        Request::Subscribe => return stream_feed(send, &service.state).await,
        Request::AddLearner { id, addr } => {
            tracing::info!(by = %describe(peer), learner = id, addr = %addr, "adding a learner");
            // Not waiting for the learner to catch up: a joiner starts only once the member that
            // forwarded this has answered it with its certificate. A learner already present (a
            // retried join) gets its address set.
            let known = raft
                .metrics()
                .borrow()
                .membership_config
                .membership()
                .get_node(&id)
                .is_some();
            if known {
                let nodes = ChangeMembers::SetNodes([(id, node(&addr))].into());
                membership_response(raft.change_membership(nodes, true).await)
            } else {
                membership_response(raft.add_learner(id, node(&addr), false).await)
            }
        }
        Request::ChangeMembership(change) => {
            tracing::info!(by = %describe(peer), change = ?change, "changing the membership");
            let changes = match change {
                MembershipChange::AddVoters(ids) => ChangeMembers::AddVoterIds(ids),
                MembershipChange::RemoveVoters(ids) => ChangeMembers::RemoveVoters(ids),
                MembershipChange::RemoveLearners(ids) => ChangeMembers::RemoveNodes(ids),
            };
            membership_response(raft.change_membership(changes, false).await)
        }
        Request::Join(join) => match &service.join {
            Some(authority) => match authority.admit(raft, &service.state, join).await {
                Ok(grant) => Response::Joined(grant),
                Err(refused) => Response::Refused(refused),
            },
            None => Response::Refused(Refusal::Failed(
                "this member does not hold the cluster CA key; join through the one that does"
                    .into(),
            )),
        },
        Request::Renew { csr_pem } => match (&service.join, peer) {
            (Some(authority), Some(principal)) => match authority.renew(&csr_pem, principal) {
                Ok(cert_pem) => Response::Renewed { cert_pem },
                Err(refused) => Response::Refused(refused),
            },
            (None, _) => Response::Refused(Refusal::NoCa),
            (Some(_), None) => Response::Refused(Refusal::Failed(
                "a renewal needs the certificate being renewed".into(),
            )),
        },
    };
    write_frame(send, &response).await
}

/// Whether this member may take a write or a membership change: it must be the leader as its
/// metrics say and a voter of its own latest membership, which a leader that appended its own
/// removal no longer is. openraft 0.9 keeps
/// such a leader running for a while (a "non-member leader") and would still take requests, and
/// a membership change appended there trips the library's own consistency checks; it is told
/// to ask the leader instead, named when known.
fn leads(service: &Service) -> Result<(), Refusal> {
    let metrics = service.raft.metrics().borrow().clone();
    let voter = metrics
        .membership_config
        .membership()
        .voter_ids()
        .any(|id| id == metrics.id);
    if metrics.state == ServerState::Leader && voter {
        return quorum_heard(service, &metrics);
    }
    let leader = metrics.current_leader.filter(|&l| l != metrics.id);
    let addr = leader.and_then(|l| {
        metrics
            .membership_config
            .membership()
            .get_node(&l)
            .map(|n| n.addr.clone())
    });
    Err(Refusal::NotLeader { leader, addr })
}

/// For a read: a leader cut off from its majority refuses at once ([`quorum_heard`]); anything
/// else goes to raft (a follower is told where the leader is).
fn leader_heard(service: &Service) -> Result<(), Refusal> {
    let metrics = service.raft.metrics().borrow().clone();
    if metrics.state == ServerState::Leader {
        quorum_heard(service, &metrics)
    } else {
        Ok(())
    }
}

/// Check-quorum: a leader that no majority has acknowledged for a leader lease (cut off from
/// it) cannot commit or serve a linearizable read, and the majority side may have elected
/// another; it says so at once, naming no leader, instead of letting its callers wait out their
/// timeouts. openraft 0.9 keeps such a member in the leader state (a leader cannot relinquish
/// leadership through its API), so this is where it steps down for its callers; the healed
/// group's newer term then replaces it in raft too.
fn quorum_heard(
    service: &Service,
    metrics: &RaftMetrics<NodeId, BasicNode>,
) -> Result<(), Refusal> {
    let unheard = metrics.millis_since_quorum_ack.map(Duration::from_millis);
    if unheard.is_some_and(|t| t > service.lease) {
        return Err(Refusal::NotLeader {
            leader: None,
            addr: None,
        });
    }
    Ok(())
}

fn membership_response(
    result: Result<
        openraft::raft::ClientWriteResponse<crate::TypeConfig>,
        RaftError<NodeId, ClientWriteError<NodeId, openraft::BasicNode>>,
    >,
) -> Response {
    match result {
        Ok(written) => Response::MembershipChanged {
            log_id: written.log_id,
        },
        Err(e) => Response::Refused(refusal(e)),
    }
}

/// The applied state with raft's view of the group.
pub fn view(service: &Service) -> ClusterView {
    let leader = service.raft.metrics().borrow().current_leader;
    service.state.with(|applied| {
        let membership = applied.membership.membership();
        ClusterView {
            leader,
            last_applied: applied.last_applied,
            voters: membership.voter_ids().collect::<BTreeSet<_>>(),
            changing: membership.get_joint_config().len() > 1,
            nodes: membership
                .nodes()
                .map(|(id, n)| (*id, n.addr.clone()))
                .collect(),
            cluster: applied.cluster.clone(),
        }
    })
}

/// Sends the applied state, then every committed change, until the subscriber goes away or
/// has to start over.
async fn stream_feed(send: &mut quinn::SendStream, state: &StateReader) -> Result<(), FrameError> {
    let (applied, mut feed) = state.subscribe();
    let start = FeedItem::Start {
        last_applied: applied.last_applied,
        cluster: applied.cluster,
    };
    write_frame(send, &Response::Feed(start)).await?;
    loop {
        let item = match feed.recv().await {
            Ok(event) => FeedItem::from(event),
            Err(FeedError::Lagged(_)) => FeedItem::Restart,
            Err(FeedError::Closed) => return Ok(()),
        };
        let restart = item == FeedItem::Restart;
        write_frame(send, &Response::Feed(item)).await?;
        if restart {
            return Ok(());
        }
    }
}
