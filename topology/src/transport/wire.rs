//! What travels on a stream: one request frame from the caller, then one response frame (or,
//! for a subscription, a sequence of them) from the member.
//!
//! A frame is a 4-byte big-endian length followed by that many bytes of JSON. Lengths above
//! [`MAX_FRAME`] are refused before anything is read or allocated, so a peer cannot make a
//! member buffer an arbitrary amount.

use std::collections::{BTreeMap, BTreeSet};

use openraft::error::{InstallSnapshotError, RaftError};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{BasicNode, LogId};
use serde::{Deserialize, Serialize};

use crate::state::{ClusterState, Command, Outcome};
use crate::store::CommittedEvent;
use crate::{NodeId, TypeConfig};

pub use strata_quic::frame::{FrameError, MAX_FRAME, read_frame, read_frame_bytes, write_frame};

/// A call on one stream.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", content = "body")]
pub enum Request {
    AppendEntries(AppendEntriesRequest<TypeConfig>),
    Vote(VoteRequest<NodeId>),
    InstallSnapshot(InstallSnapshotRequest<TypeConfig>),
    /// Commit a command; only the leader accepts it.
    Propose(Command),
    /// A linearizable read of the whole view; only the leader answers.
    Read,
    /// The applied state, then every committed change after it, until either side closes.
    Subscribe,
    AddLearner {
        id: NodeId,
        addr: String,
    },
    ChangeMembership(MembershipChange),
    /// Present a join token and a certificate request; answered with a certificate.
    Join(JoinRequest),
    /// Ask for a new certificate for the identity the caller's current one names (member or
    /// operator), for the key in this certificate request; only a member holding the CA key
    /// signs it.
    Renew {
        csr_pem: String,
    },
    /// Would you vote for me in `term`? (`election`: asked before standing; changes nothing.)
    /// `last_applied`: the asker's last applied log id (absent from members before it was
    /// added, which are answered by the lease alone).
    PreVote {
        term: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        last_applied: Option<LogId<NodeId>>,
    },
}

impl Request {
    /// Whether this is a raft RPC, which only members may send.
    pub fn is_raft(&self) -> bool {
        matches!(
            self,
            Request::AppendEntries(_)
                | Request::Vote(_)
                | Request::InstallSnapshot(_)
                | Request::PreVote { .. }
        )
    }

    /// The member on whose behalf a raft RPC claims to speak.
    pub fn raft_sender(&self) -> Option<NodeId> {
        match self {
            Request::AppendEntries(rpc) => rpc.vote.leader_id().voted_for(),
            Request::Vote(rpc) => rpc.vote.leader_id().voted_for(),
            Request::InstallSnapshot(rpc) => rpc.vote.leader_id().voted_for(),
            _ => None,
        }
    }
}

/// Changes to the raft voter set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MembershipChange {
    /// Makes learners voters.
    AddVoters(BTreeSet<NodeId>),
    /// Removes voters from the group altogether.
    RemoveVoters(BTreeSet<NodeId>),
    /// Removes learners.
    RemoveLearners(BTreeSet<NodeId>),
}

/// A joiner's token and certificate request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JoinRequest {
    pub secret: String,
    pub csr_pem: String,
    /// Where the joiner will listen for raft and client RPCs.
    pub raft_addr: String,
}

/// What a join returns: the id the group chose and a certificate naming it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JoinGrant {
    pub id: NodeId,
    pub cert_pem: String,
    pub ca_pem: String,
}

/// The linearizable view clients read: the cluster state and raft's view of the group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterView {
    pub leader: Option<NodeId>,
    pub last_applied: Option<LogId<NodeId>>,
    pub voters: BTreeSet<NodeId>,
    /// A membership change is under way: raft runs on a joint configuration (old and new voter
    /// sets, each needing its own majority) until the new one alone is committed. `voters` is
    /// then the union of both sets.
    #[serde(default)]
    pub changing: bool,
    /// Every raft node (voters and learners) with its address.
    pub nodes: BTreeMap<NodeId, String>,
    pub cluster: ClusterState,
}

/// One item of a subscription.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FeedItem {
    /// The first item: the applied state the changes continue from.
    Start {
        last_applied: Option<LogId<NodeId>>,
        cluster: ClusterState,
    },
    Applied {
        log_id: LogId<NodeId>,
        command: Option<Command>,
        outcome: Outcome,
    },
    /// The state was replaced by a snapshot, or the subscriber fell behind: subscribe again.
    Restart,
}

impl From<CommittedEvent> for FeedItem {
    fn from(event: CommittedEvent) -> Self {
        match event {
            CommittedEvent::Applied {
                log_id,
                command,
                outcome,
            } => FeedItem::Applied {
                log_id,
                command,
                outcome,
            },
            CommittedEvent::Replaced { .. } => FeedItem::Restart,
        }
    }
}

/// Why a member refused or failed a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum Refusal {
    #[error("malformed request: {0}")]
    Malformed(String),
    #[error("frame of {0} bytes exceeds the limit of {MAX_FRAME}")]
    Oversize(u64),
    #[error("no whole request arrived within {ms} ms of the stream opening")]
    ReadTimeout { ms: u64 },
    #[error("raft RPC claims sender {claimed} but the peer certificate names member {peer}")]
    WrongSender { claimed: NodeId, peer: NodeId },
    #[error("raft RPCs are for members; the peer certificate names operator {operator}")]
    OperatorRaft { operator: String },
    /// A raft RPC from a member certificate whose id is in no configuration of the group.
    #[error("raft RPC from member {peer}, which is not in the group's membership")]
    NotInGroup { peer: NodeId },
    #[error("not the leader; the leader is {leader:?} at {addr:?}")]
    NotLeader {
        leader: Option<NodeId>,
        addr: Option<String>,
    },
    #[error("{0}")]
    Failed(String),
    /// The peer's certificate names an identity the group has revoked.
    #[error("the certificate of {0} has been revoked")]
    Revoked(String),
    /// The group refused the join token itself (unknown, expired, spent for another key): asking
    /// again cannot succeed.
    #[error("join refused: {0}")]
    JoinRefused(String),
    /// A renewal asked of a member that does not hold the CA key.
    #[error("this member does not hold the cluster CA key")]
    NoCa,
    /// The peer's certificate is past its end (its connection outlived it).
    #[error("the certificate of {0} has expired")]
    Expired(String),
}

/// A member's answer.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", content = "body")]
pub enum Response {
    AppendEntries(Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>>),
    Vote(Result<VoteResponse<NodeId>, RaftError<NodeId>>),
    InstallSnapshot(
        Result<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>>,
    ),
    Proposed {
        log_id: LogId<NodeId>,
        outcome: Outcome,
    },
    View(Box<ClusterView>),
    Feed(FeedItem),
    /// A membership change or learner addition committed at this log id.
    MembershipChanged {
        log_id: LogId<NodeId>,
    },
    Joined(JoinGrant),
    /// A renewed certificate, PEM.
    Renewed {
        cert_pem: String,
    },
    /// The answer to a pre-vote.
    PreVote {
        granted: bool,
    },
    Refused(Refusal),
}

/// The node record raft keeps for a member: its address.
pub fn node(addr: &str) -> BasicNode {
    BasicNode::new(addr)
}
