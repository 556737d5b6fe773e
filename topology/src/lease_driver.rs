//! The lease driver: on whichever member leads, it proposes `EvaluateLeases` when a lease has
//! run out, so that suspect and down verdicts are committed entries stamped with the leader's
//! clock — never something a replica concludes from its own clock.
//!
//! A new leader waits `down_after_ms` before its first evaluation: heartbeats proposed during
//! the election went to a leader that no longer leads and were lost, and a leader change is no
//! evidence against the members. Without the grace, every election could mark healthy members
//! down.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use std::collections::BTreeSet;

use openraft::error::{ClientWriteError, RaftError};
use openraft::{BasicNode, ChangeMembers, Membership};

use crate::state::{Change, ClusterState, Command};
use crate::store::StateReader;
use crate::{NodeId, Raft};

/// Milliseconds on the proposer's clock.
pub trait Clock: Send + Sync + 'static {
    fn now_ms(&self) -> u64;
}

/// Wall time: milliseconds since the Unix epoch.
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }
}

/// Whether an evaluation at `now_ms` would commit a transition, given that this member has led
/// since `leading_since_ms`.
pub fn evaluation_due(state: &ClusterState, leading_since_ms: u64, now_ms: u64) -> bool {
    let policy = state.health_policy();
    if now_ms.saturating_sub(leading_since_ms) < policy.down_after_ms {
        return false;
    }
    // Judge at group time, as `apply` will: it never runs behind the largest clock applied.
    let at = now_ms.max(state.clock_ms());
    state
        .members()
        .values()
        .any(|m| policy.verdict(m.lease.renewed_ms, at) > m.lease.health)
}

/// Runs on every member; acts only while its member leads.
/// Learners left by joins that never finished: admitted by a join token that has expired at
/// `now_ms` (or the group's later time), in the membership but not voters, and never recorded as
/// members. Past its token's TTL a joiner can no longer retry, so nothing will start them.
pub fn orphan_learners(
    state: &ClusterState,
    membership: &Membership<NodeId, BasicNode>,
    now_ms: u64,
) -> BTreeSet<NodeId> {
    let at = now_ms.max(state.clock_ms());
    let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
    state
        .join_tokens()
        .tokens()
        .values()
        .filter(|t| t.expired(at))
        .filter_map(|t| t.consumed_by)
        .filter(|id| membership.get_node(id).is_some() && !voters.contains(id))
        .filter(|id| !state.members().contains_key(id))
        .collect()
}

pub struct LeaseDriver {
    raft: Raft,
    state: StateReader,
    clock: Arc<dyn Clock>,
    interval: Duration,
}

impl LeaseDriver {
    pub fn new(raft: Raft, state: StateReader, clock: Arc<dyn Clock>, interval: Duration) -> Self {
        Self {
            raft,
            state,
            clock,
            interval,
        }
    }

    /// Loops until the raft node stops.
    pub async fn run(self) {
        let mut ticks = tokio::time::interval(self.interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut leading_since: Option<u64> = None;
        loop {
            ticks.tick().await;
            let (running, leads) = {
                let metrics = self.raft.metrics();
                let m = metrics.borrow();
                (m.running_state.is_ok(), m.state.is_leader())
            };
            if !running {
                return;
            }
            let now = self.clock.now_ms();
            if !leads {
                leading_since = None;
                continue;
            }
            let since = *leading_since.get_or_insert(now);
            let orphans = self
                .state
                .with(|s| orphan_learners(&s.cluster, s.membership.membership(), now));
            if !orphans.is_empty() {
                tracing::warn!(learners = ?orphans, "removing learners whose joins never finished");
                if let Err(e) = self
                    .raft
                    .change_membership(ChangeMembers::RemoveNodes(orphans), false)
                    .await
                {
                    tracing::warn!(error = %e, "orphan learners were not removed");
                }
            }
            if !self.state.with(|s| evaluation_due(&s.cluster, since, now)) {
                continue;
            }
            let command = Command::new(now, Change::EvaluateLeases);
            match self.raft.client_write(command).await {
                Ok(_) => {}
                Err(RaftError::Fatal(_)) => return,
                // Lost leadership meanwhile: the next leader evaluates after its grace.
                Err(RaftError::APIError(ClientWriteError::ForwardToLeader(_))) => {
                    leading_since = None;
                }
                Err(RaftError::APIError(e)) => {
                    tracing::warn!(error = %e, "lease evaluation was not committed");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{HealthPolicy, test_spec};

    fn state_with_member_renewed_at(renewed_ms: u64) -> ClusterState {
        let mut s = ClusterState::default();
        s.apply(&Command::new(
            0,
            Change::SetHealthPolicy(HealthPolicy {
                suspect_after_ms: 100,
                down_after_ms: 300,
            }),
        ))
        .unwrap();
        s.apply(&Command::new(
            renewed_ms,
            Change::AddMember(test_spec(1, &[])),
        ))
        .unwrap();
        s
    }

    #[test]
    fn a_learner_whose_join_token_expired_unrecorded_is_an_orphan() {
        let mut s = ClusterState::default();
        for (sha, ttl) in [("ab", 1_000), ("cd", 1_000), ("ef", 10_000)] {
            let put = Change::PutJoinToken {
                sha256: sha.repeat(32),
                ttl_ms: ttl,
            };
            s.apply(&Command::new(0, put)).unwrap();
        }
        for (sha, id) in [("ab", 2), ("cd", 3), ("ef", 4)] {
            let consume = Change::ConsumeJoinToken {
                sha256: sha.repeat(32),
                id,
                key_sha256: None,
            };
            s.apply(&Command::new(10, consume)).unwrap();
        }
        // Member 3 finished its join (recorded); 2 never did; 4's token still lives.
        s.apply(&Command::new(20, Change::AddMember(test_spec(3, &[]))))
            .unwrap();
        let membership = Membership::new(vec![[1].into()], Some([1, 2, 3, 4].into()));
        assert_eq!(orphan_learners(&s, &membership, 500), BTreeSet::new());
        assert_eq!(orphan_learners(&s, &membership, 1_000), [2].into());
        // Canary arms: a voter or a node already removed is never an orphan.
        let membership = Membership::new(vec![[1, 2].into()], None);
        assert_eq!(orphan_learners(&s, &membership, 1_000), BTreeSet::new());
    }

    #[test]
    fn a_new_leader_waits_out_the_down_interval() {
        let s = state_with_member_renewed_at(1_000);
        // The lease ran out long ago, but this member has only led for 299 ms.
        assert!(!evaluation_due(&s, 5_000, 5_299));
        assert!(evaluation_due(&s, 5_000, 5_300));
    }

    #[test]
    fn nothing_is_proposed_while_every_verdict_stands() {
        let mut s = state_with_member_renewed_at(1_000);
        assert!(!evaluation_due(&s, 0, 1_099), "lease still fresh");
        assert!(evaluation_due(&s, 0, 1_100), "suspect is due");
        s.apply(&Command::new(1_100, Change::EvaluateLeases))
            .unwrap();
        assert!(!evaluation_due(&s, 0, 1_200), "already suspect");
        assert!(evaluation_due(&s, 0, 1_300), "down is due");
        s.apply(&Command::new(1_300, Change::EvaluateLeases))
            .unwrap();
        assert!(!evaluation_due(&s, 0, 9_999), "already down");
    }

    #[test]
    fn a_slow_leader_clock_is_judged_at_group_time() {
        let mut s = state_with_member_renewed_at(1_000);
        s.apply(&Command::new(1_050, Change::Heartbeat { id: 1 }))
            .unwrap();
        // Another member's command advanced group time to 2_000 …
        s.apply(&Command::new(
            2_000,
            Change::SetRole {
                id: 1,
                role: crate::state::RaftRole::Voter,
            },
        ))
        .unwrap();
        // … so even a leader whose clock reads 1_060 finds the lease (renewed at 1_050) run out.
        assert!(evaluation_due(&s, 0, 1_060));
    }
}
