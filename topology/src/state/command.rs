//! What clients propose (`Command`) and what applying it committed (`Outcome`).

use serde::{Deserialize, Serialize};

use super::health::{HealthPolicy, HealthTransition};
use super::join_tokens::{DEFAULT_JOIN_TOKEN_TTL_MS, UnixMillis};
use super::members::{MemberSpec, NodeId, RaftRole};
use super::placement::{PlacementRequest, TpGroup};

/// The raft log's application entry: a change stamped with the proposer's clock.
///
/// `at_ms` is the only time the state machine ever sees. The state keeps the largest value
/// applied so far, so a proposer with a slow clock cannot move group time backwards.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Command {
    /// Milliseconds on the proposer's clock (Unix epoch in production, anything monotone in
    /// tests).
    pub at_ms: u64,
    pub change: Change,
}

impl Command {
    pub fn new(at_ms: u64, change: Change) -> Self {
        Self { at_ms, change }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Change {
    /// Adds a member (alive, with a fresh lease).
    AddMember(MemberSpec),
    /// Replaces a member's declaration (addresses, GPUs, capacity, labels, role), keeping its
    /// lease.
    UpdateMember(MemberSpec),
    /// Removes a member and its placement groups.
    RemoveMember {
        id: NodeId,
    },
    SetRole {
        id: NodeId,
        role: RaftRole,
    },
    /// Renews a member's lease; a suspect or down member becomes alive.
    Heartbeat {
        id: NodeId,
    },
    /// Judges every lease at this command's clock and commits the resulting transitions.
    EvaluateLeases,
    SetHealthPolicy(HealthPolicy),
    /// Places (or re-places) a model.
    PlaceModel(PlacementRequest),
    RemoveModel {
        model: String,
    },
    PutTenant {
        name: String,
    },
    /// Removes a tenant and all of its keys.
    RemoveTenant {
        name: String,
    },
    PutApiKey {
        id: String,
        tenant: String,
        sha256: String,
    },
    RevokeApiKey {
        id: String,
    },
    RegisterRouter {
        id: String,
        http_addr: String,
    },
    DeregisterRouter {
        id: String,
    },
    /// Records a join token by the SHA-256 of its secret; it admits a joiner until `ttl_ms`
    /// after this command's time.
    PutJoinToken {
        sha256: String,
        /// Absent in entries written before tokens expired: the default TTL.
        #[serde(default = "default_join_token_ttl_ms")]
        ttl_ms: u64,
    },
    /// Withdraws member `id`'s certificate: every member refuses calls from it (after it left;
    /// revoking twice is no change).
    RevokeMember {
        id: NodeId,
    },
    /// Withdraws every certificate issued to operator `name`.
    RevokeOperator {
        name: String,
    },
    /// Spends a join token, admitting member `id` with the public key whose SHA-256 is
    /// `key_sha256`; refused once the token has expired at this command's time. The same key and
    /// id again (a joiner retrying) is accepted and changes nothing.
    ConsumeJoinToken {
        sha256: String,
        id: NodeId,
        #[serde(default)]
        key_sha256: Option<String>,
    },
}

fn default_join_token_ttl_ms() -> u64 {
    DEFAULT_JOIN_TOKEN_TTL_MS
}

/// What an applied entry did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Applied {
    /// The ring epoch after this entry.
    pub ring_epoch: u64,
    /// Health transitions this entry committed.
    pub transitions: Vec<HealthTransition>,
    /// The groups of a `PlaceModel`.
    pub placed: Vec<TpGroup>,
    /// Keys revoked along with a removed tenant, groups dropped with a removed member.
    pub removed: usize,
}

/// Why a committed command changed nothing. Rejections are deterministic: every replica
/// rejects the same entry for the same reason.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum Rejection {
    #[error("member {id}: {why}")]
    InvalidMember { id: NodeId, why: String },
    #[error("member {0} is already registered")]
    MemberExists(NodeId),
    #[error("no member {0}")]
    UnknownMember(NodeId),
    #[error("invalid health policy: suspect_after_ms must be positive and below down_after_ms")]
    InvalidHealthPolicy,
    #[error("model `{model}`: {why}")]
    InvalidPlacement { model: String, why: String },
    #[error("model `{model}`: {placeable} of {wanted} groups fit on healthy members")]
    InsufficientCapacity {
        model: String,
        wanted: u32,
        placeable: u32,
    },
    #[error("invalid name {0:?}: non-empty printable text without spaces, at most 128 bytes")]
    InvalidName(String),
    #[error("key `{id}`: the hash must be 64 lowercase hex digits (a SHA-256), never the key")]
    InvalidKeyHash { id: String },
    #[error("{0} already exists")]
    AlreadyExists(String),
    #[error("no {0}")]
    NotFound(String),
    #[error(
        "join token expired at {} ({} ms before this join, at {}); issue a new token",
        UnixMillis(*.expired_ms),
        .now_ms.saturating_sub(*.expired_ms),
        UnixMillis(*.now_ms)
    )]
    JoinTokenExpired { expired_ms: u64, now_ms: u64 },
}

/// The state machine's response to one log entry.
pub type Outcome = Result<Applied, Rejection>;
