//! What a raft RPC must be before openraft sees it. openraft trusts its peers (raft's model has
//! no Byzantine members): it asserts, and in places unwraps, that an AppendEntries or a snapshot
//! carries a committed vote and that entries follow one another from the previous log id. A
//! holder of a member certificate that is not in the group could send otherwise and stop a
//! member's raft core for good: the hostile-peer campaign in topology/tests/quic.rs stopped all
//! three members' cores with one AppendEntries under an uncommitted vote.
//!
//! So a raft RPC is taken only from a member of the group's effective membership (voters and
//! learners of every configuration in force, joint ones included; a member that knows none yet
//! takes any) and only when well formed.
//! Members are still trusted to follow the protocol: a member of the group that lies within
//! well-formed messages is outside what raft defends against.

use std::collections::BTreeSet;

use openraft::EntryPayload;

use super::wire::{Refusal, Request};
use crate::NodeId;

/// Refuses a raft RPC from `peer` when `peer` is not among `members`. A member that knows no
/// membership yet (one being initialized, a learner before its first entries) takes them from
/// any member certificate: it has no group to tell members from strangers by.
pub fn from_a_member(
    request: &Request,
    peer: NodeId,
    members: &BTreeSet<NodeId>,
) -> Result<(), Refusal> {
    if request.is_raft() && !members.is_empty() && !members.contains(&peer) {
        return Err(Refusal::NotInGroup { peer });
    }
    Ok(())
}

/// Refuses a raft RPC openraft would take for a protocol violation.
pub fn well_formed(request: &Request) -> Result<(), Refusal> {
    let malformed = |why: String| Err(Refusal::Malformed(why));
    match request {
        Request::AppendEntries(rpc) => {
            if !rpc.vote.is_committed() {
                return malformed(format!(
                    "append-entries under an uncommitted vote {}",
                    rpc.vote
                ));
            }
            let first = rpc.prev_log_id.map_or(0, |l| l.index + 1);
            let term = rpc.vote.leader_id().term;
            for (next, entry) in (first..).zip(&rpc.entries) {
                if entry.log_id.index != next {
                    return malformed(format!(
                        "entry {} where {next} follows the previous log id",
                        entry.log_id
                    ));
                }
                if entry.log_id.leader_id.term > term {
                    return malformed(format!("entry {} beyond the vote's term", entry.log_id));
                }
                if let EntryPayload::Membership(m) = &entry.payload
                    && m.voter_ids().next().is_none()
                {
                    return malformed(format!(
                        "entry {}: a membership without voters",
                        entry.log_id
                    ));
                }
            }
            if let (Some(commit), Some(prev)) = (rpc.leader_commit, rpc.prev_log_id)
                && commit.leader_id.term > term
                && commit.index > prev.index
            {
                return malformed(format!("commit {commit} beyond the vote's term"));
            }
            Ok(())
        }
        Request::InstallSnapshot(rpc) if !rpc.vote.is_committed() => {
            malformed(format!("a snapshot under an uncommitted vote {}", rpc.vote))
        }
        Request::Vote(rpc) if rpc.vote.is_committed() => malformed(format!(
            "a vote request under a committed vote {}",
            rpc.vote
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use openraft::raft::{AppendEntriesRequest, VoteRequest};
    use openraft::{CommittedLeaderId, Entry, LogId, Vote};

    use super::*;

    fn entry(term: u64, index: u64) -> Entry<crate::TypeConfig> {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(term, 1), index),
            payload: EntryPayload::Blank,
        }
    }

    fn append(
        vote: Vote<NodeId>,
        prev: Option<u64>,
        entries: Vec<Entry<crate::TypeConfig>>,
    ) -> Request {
        Request::AppendEntries(AppendEntriesRequest {
            vote,
            prev_log_id: prev.map(|i| LogId::new(CommittedLeaderId::new(2, 1), i)),
            entries,
            leader_commit: None,
        })
    }

    #[test]
    fn a_leaders_well_formed_messages_pass() {
        let vote = Vote::new_committed(3, 1);
        assert!(well_formed(&append(vote, Some(4), vec![entry(2, 5), entry(3, 6)])).is_ok());
        assert!(well_formed(&append(vote, None, vec![entry(1, 0)])).is_ok());
        assert!(well_formed(&append(vote, Some(9), vec![])).is_ok());
        let ask = Request::Vote(VoteRequest::new(Vote::new(4, 2), None));
        assert!(well_formed(&ask).is_ok());
    }

    #[test]
    fn what_openraft_would_assert_on_is_refused() {
        let uncommitted = append(Vote::new(3, 1), Some(4), vec![entry(3, 5)]);
        assert!(matches!(
            well_formed(&uncommitted),
            Err(Refusal::Malformed(_))
        ));
        let vote = Vote::new_committed(3, 1);
        let gap = append(vote, Some(4), vec![entry(3, 6)]);
        assert!(matches!(well_formed(&gap), Err(Refusal::Malformed(_))));
        let future = append(vote, Some(4), vec![entry(9, 5)]);
        assert!(matches!(well_formed(&future), Err(Refusal::Malformed(_))));
        let ask = Request::Vote(VoteRequest::new(Vote::new_committed(4, 2), None));
        assert!(matches!(well_formed(&ask), Err(Refusal::Malformed(_))));
    }

    #[test]
    fn raft_rpcs_only_from_the_group() {
        let members: BTreeSet<NodeId> = [1, 2, 3].into();
        let ask = Request::Vote(VoteRequest::new(Vote::new(4, 100), None));
        assert!(matches!(
            from_a_member(&ask, 100, &members),
            Err(Refusal::NotInGroup { peer: 100 })
        ));
        assert!(from_a_member(&ask, 2, &members).is_ok());
        assert!(
            from_a_member(&Request::Read, 100, &members).is_ok(),
            "clients are not raft"
        );
    }
}
