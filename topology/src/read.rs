//! Linearizable reads: a read that reflects every write acknowledged before it started.
//!
//! The read-index protocol (raft §8): the leader confirms with a quorum that it still leads,
//! takes its commit index as the read index, and the read waits until the local state machine
//! has applied that far. Only a confirmed leader answers; a follower or a leader cut off from
//! its quorum returns an error instead of a possibly stale state.

use openraft::BasicNode;
use openraft::error::{CheckIsLeaderError, RaftError};

use crate::state::ClusterState;
use crate::store::StateReader;
use crate::{NodeId, Raft};

/// Why a linearizable read was refused; `ForwardToLeader` names where to ask instead.
pub type ReadError = RaftError<NodeId, CheckIsLeaderError<NodeId, BasicNode>>;

/// Runs `f` on a state that includes every write committed before this call.
pub async fn read_linearizable<T>(
    raft: &Raft,
    state: &StateReader,
    f: impl FnOnce(&ClusterState) -> T,
) -> Result<T, ReadError> {
    raft.ensure_linearizable().await?;
    Ok(state.with(|applied| f(&applied.cluster)))
}
