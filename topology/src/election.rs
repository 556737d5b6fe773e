//! Elections with a pre-vote: a member that stopped hearing from the leader first asks the
//! voters whether they have too, and stands only if a majority has.
//!
//! openraft 0.9 has no pre-vote. Without one, a follower that was paused (SIGSTOP, a long GC,
//! a swapped-out process) wakes past its election timeout, raises its term and stands; the
//! others refuse it while the leader's lease holds, but the leader meets the higher term in its
//! next replication answer from that follower and steps down: one election, seconds without a
//! leader, for nothing. So members run raft with its own elections off (`enable_elect = false`)
//! and [`drive`] decides when to stand, through openraft's `trigger().elect()`:
//!
//! - every member records when it last heard from a leader ([`LeaderContact`]: an append or a
//!   snapshot accepted, a vote granted);
//! - a voter that has not for the leader lease plus a random election timeout (openraft's own
//!   rule for a follower that knew a leader) sends `PreVote` to the other voters;
//! - a voter grants it only if it is not the leader, has not heard from one for the leader
//!   lease itself — then its lease no longer refuses the real vote either — and has applied no
//!   more of the log than the asker (its last applied log id is not greater);
//! - with a majority of grants (its own included) the member stands; otherwise it waits another
//!   timeout. A pre-vote changes no state anywhere: terms rise only in elections that can be
//!   won by a member that lost touch along with a majority.
//!
//! The pre-vote compares what each member has applied, not its whole log (openraft does not
//! expose the last log id; the real vote that follows compares logs). Without that comparison a
//! member back from a long absence, far behind, was granted pre-votes and stood again and again
//! at the same terms as the up-to-date members, whose candidacies its own kept deposing: under
//! load a group went a minute without a leader (tests/cluster_processes.rs, certificates renewed
//! after members were down). With it the member that applied the most is refused by nobody who
//! lost the leader, so some member can always stand; the others wait for it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use openraft::{LogId, ServerState};
use ring::rand::SecureRandom;

use crate::server::Timing;
use crate::transport::Client;
use crate::transport::wire::{Request, Response};
use crate::{NodeId, Raft};

/// When this member last heard from a leader.
#[derive(Debug)]
pub struct LeaderContact {
    start: Instant,
    /// Milliseconds after `start`.
    last_ms: AtomicU64,
}

impl Default for LeaderContact {
    /// Heard just now: a member that starts waits a whole timeout before it stands.
    fn default() -> Self {
        Self {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }
}

impl LeaderContact {
    pub fn heard(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.fetch_max(ms, Ordering::Relaxed);
    }

    /// How long ago.
    pub fn since(&self) -> Duration {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(last)
    }
}

/// Whether this member grants a pre-vote: it does not lead, has not heard from a leader for
/// `lease`, and the asker has applied at least what it has ([`applied_allows`]).
pub fn grants_pre_vote(
    raft: &Raft,
    contact: &LeaderContact,
    lease: Duration,
    asker_applied: Option<LogId<NodeId>>,
) -> bool {
    let metrics = raft.metrics().borrow().clone();
    metrics.state != ServerState::Leader
        && contact.since() >= lease
        && applied_allows(asker_applied, metrics.last_applied)
}

/// The asker's last applied log id against this member's: not behind it. An asker that sent
/// none (an older member, or one that applied nothing) is answered by the lease alone.
pub fn applied_allows(asker: Option<LogId<NodeId>>, mine: Option<LogId<NodeId>>) -> bool {
    match asker {
        None => true,
        Some(asker) => mine.is_none_or(|mine| asker >= mine),
    }
}

/// How often [`drive`] looks.
const TICK: Duration = Duration::from_millis(50);

/// Decides when this member stands for election (module doc) until its raft stops.
pub async fn drive(raft: Raft, client: Client, contact: Arc<LeaderContact>, timing: Timing) {
    let lease = Duration::from_millis(timing.election_timeout_max_ms);
    // A voter that does not answer a pre-vote by then (a dead leader's connection waits for
    // its idle timeout) counts as a refusal.
    let answer_within = Duration::from_millis(timing.election_timeout_min_ms);
    let mut timeout = lease + random_timeout(&timing);
    // The last pre-vote this member asked for: it asks again only a whole timeout later.
    let mut asked = Instant::now();
    loop {
        tokio::time::sleep(TICK).await;
        let metrics = raft.metrics().borrow().clone();
        if metrics.running_state.is_err() {
            return;
        }
        if metrics.state == ServerState::Leader {
            contact.heard();
            continue;
        }
        let membership = metrics.membership_config.membership().clone();
        let voters: Vec<_> = membership.voter_ids().collect();
        if !voters.contains(&metrics.id) || contact.since() < timeout || asked.elapsed() < timeout {
            continue;
        }
        let others: Vec<String> = voters
            .iter()
            .filter(|&&id| id != metrics.id)
            .filter_map(|id| membership.get_node(id).map(|n| n.addr.clone()))
            .collect();
        let request = Request::PreVote {
            term: metrics.current_term + 1,
            last_applied: metrics.last_applied,
        };
        let granted = match timing.pre_vote {
            true => 1 + pre_votes(&client, &others, &request, voters.len(), answer_within).await,
            // Without pre-vote every voter counts as granting: stand now.
            false => voters.len(),
        };
        let stand = 2 * granted > voters.len();
        tracing::info!(
            granted,
            voters = voters.len(),
            stand,
            silent_for = ?contact.since(),
            "pre-vote"
        );
        if stand && let Err(e) = raft.trigger().elect().await {
            tracing::warn!(error = %e, "could not stand for election");
            return;
        }
        asked = Instant::now();
        timeout = lease + random_timeout(&timing);
    }
}

/// How many of `others` grant `request`: counted as the answers come, stopping once this member
/// (which grants itself) has a majority of `voters`, or at `within`.
async fn pre_votes(
    client: &Client,
    others: &[String],
    request: &Request,
    voters: usize,
    within: Duration,
) -> usize {
    use futures_util::StreamExt;
    let mut answers: futures_util::stream::FuturesUnordered<_> = others
        .iter()
        .map(|addr| async move {
            matches!(
                client.call(addr, request).await,
                Ok(Response::PreVote { granted: true })
            )
        })
        .collect();
    let mut granted = 0;
    let count = async {
        while let Some(grant) = answers.next().await {
            granted += usize::from(grant);
            if 2 * (granted + 1) > voters {
                break;
            }
        }
    };
    let _ = tokio::time::timeout(within, count).await;
    granted
}

/// A random election timeout between the configured bounds.
fn random_timeout(timing: &Timing) -> Duration {
    let (min, max) = (
        timing.election_timeout_min_ms,
        timing.election_timeout_max_ms,
    );
    let mut bytes = [0u8; 8];
    let spread = max.saturating_sub(min);
    let jitter = match ring::rand::SystemRandom::new().fill(&mut bytes) {
        Ok(()) if spread > 0 => u64::from_le_bytes(bytes) % spread,
        _ => spread / 2,
    };
    Duration::from_millis(min + jitter)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(term: u64, leader: NodeId, index: u64) -> Option<LogId<NodeId>> {
        Some(LogId::new(
            openraft::CommittedLeaderId::new(term, leader),
            index,
        ))
    }

    #[test]
    fn a_pre_vote_needs_the_asker_to_have_applied_as_much() {
        // The case that kept a group leaderless: an asker back from an absence, far behind.
        assert!(!applied_allows(log(1, 1, 18), log(33, 1, 52)));
        assert!(!applied_allows(log(33, 1, 51), log(33, 1, 52)));
        assert!(applied_allows(log(33, 1, 52), log(33, 1, 52)));
        assert!(applied_allows(log(34, 2, 53), log(33, 1, 52)));
        // A later term wins over a longer index, as raft orders logs.
        assert!(applied_allows(log(34, 2, 40), log(33, 1, 52)));
        // Nothing applied here; an asker that sent nothing (an older member) keeps the old rule.
        assert!(applied_allows(log(1, 1, 1), None));
        assert!(applied_allows(None, log(33, 1, 52)));
    }

    #[test]
    fn contact_counts_from_the_last_time_heard() {
        let contact = LeaderContact::default();
        std::thread::sleep(Duration::from_millis(30));
        assert!(contact.since() >= Duration::from_millis(30));
        contact.heard();
        assert!(contact.since() < Duration::from_millis(30));
    }

    #[test]
    fn timeouts_fall_within_the_bounds() {
        let timing = Timing::default();
        for _ in 0..200 {
            let t = random_timeout(&timing).as_millis() as u64;
            assert!(
                (timing.election_timeout_min_ms..timing.election_timeout_max_ms).contains(&t),
                "{t}"
            );
        }
    }
}
