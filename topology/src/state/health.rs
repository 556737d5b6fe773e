//! Health by lease: a member is alive while it keeps heartbeating; a lease that runs past
//! `suspect_after_ms` makes it suspect, past `down_after_ms` down.
//!
//! Time never comes from the machine applying a command: every command carries the proposer's
//! clock, the state keeps the largest value seen, and leases are judged against that. So every
//! replica applying the same log reaches the same verdicts, and each verdict is itself part of a
//! committed entry (`Change::EvaluateLeases`), never something a replica decides on its own.

use serde::{Deserialize, Serialize};

use super::members::NodeId;

/// A member's health as the group has committed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Health {
    Alive,
    /// Missed heartbeats for `suspect_after_ms`: still owns its share of the ring (one late
    /// heartbeat should not move ownership), but routers should prefer others.
    Suspect,
    /// Missed heartbeats for `down_after_ms`: out of the ring, its requests fail over.
    Down,
}

/// How long a lease may run before the member is suspected, then declared down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthPolicy {
    pub suspect_after_ms: u64,
    pub down_after_ms: u64,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        Self {
            suspect_after_ms: 3_000,
            down_after_ms: 10_000,
        }
    }
}

impl HealthPolicy {
    pub fn is_valid(&self) -> bool {
        self.suspect_after_ms > 0 && self.suspect_after_ms < self.down_after_ms
    }

    /// The health a lease last renewed at `renewed_ms` deserves at `now_ms`.
    pub fn verdict(&self, renewed_ms: u64, now_ms: u64) -> Health {
        let silent = now_ms.saturating_sub(renewed_ms);
        if silent >= self.down_after_ms {
            Health::Down
        } else if silent >= self.suspect_after_ms {
            Health::Suspect
        } else {
            Health::Alive
        }
    }
}

/// One member's lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub health: Health,
    /// Group clock of the last heartbeat (or of joining).
    pub renewed_ms: u64,
    /// Group clock at which `health` was entered.
    pub since_ms: u64,
}

impl Lease {
    pub fn new(now_ms: u64) -> Self {
        Self {
            health: Health::Alive,
            renewed_ms: now_ms,
            since_ms: now_ms,
        }
    }

    /// Renews the lease; a suspect or down member that heartbeats is alive again.
    pub fn renew(&mut self, node: NodeId, now_ms: u64) -> Option<HealthTransition> {
        self.renewed_ms = now_ms;
        self.enter(node, Health::Alive, now_ms)
    }

    /// Applies the policy's verdict at `now_ms`.
    pub fn evaluate(
        &mut self,
        node: NodeId,
        policy: &HealthPolicy,
        now_ms: u64,
    ) -> Option<HealthTransition> {
        let verdict = policy.verdict(self.renewed_ms, now_ms);
        self.enter(node, verdict, now_ms)
    }

    fn enter(&mut self, node: NodeId, health: Health, now_ms: u64) -> Option<HealthTransition> {
        if self.health == health {
            return None;
        }
        let transition = HealthTransition {
            node,
            from: self.health,
            to: health,
            at_ms: now_ms,
        };
        self.health = health;
        self.since_ms = now_ms;
        Some(transition)
    }
}

/// A committed change of a member's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthTransition {
    pub node: NodeId,
    pub from: Health,
    pub to: Health,
    pub at_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdict_thresholds_are_inclusive() {
        let p = HealthPolicy {
            suspect_after_ms: 100,
            down_after_ms: 300,
        };
        assert_eq!(p.verdict(1_000, 1_099), Health::Alive);
        assert_eq!(p.verdict(1_000, 1_100), Health::Suspect);
        assert_eq!(p.verdict(1_000, 1_299), Health::Suspect);
        assert_eq!(p.verdict(1_000, 1_300), Health::Down);
        // A clock behind the renewal (a new leader with a slower clock) is not silence.
        assert_eq!(p.verdict(1_000, 10), Health::Alive);
    }

    #[test]
    fn lease_walks_alive_suspect_down_and_back() {
        let p = HealthPolicy {
            suspect_after_ms: 100,
            down_after_ms: 300,
        };
        let mut lease = Lease::new(0);
        assert_eq!(lease.evaluate(7, &p, 50), None);
        let t = lease.evaluate(7, &p, 150).expect("suspect");
        assert_eq!(
            (t.from, t.to, t.at_ms),
            (Health::Alive, Health::Suspect, 150)
        );
        assert_eq!(lease.evaluate(7, &p, 200), None, "no repeated transition");
        let t = lease.evaluate(7, &p, 400).expect("down");
        assert_eq!((t.from, t.to), (Health::Suspect, Health::Down));
        assert_eq!(lease.since_ms, 400);
        let t = lease.renew(7, 500).expect("alive again");
        assert_eq!((t.from, t.to), (Health::Down, Health::Alive));
        assert_eq!(lease.renewed_ms, 500);
        assert_eq!(lease.renew(7, 510), None);
    }

    #[test]
    fn policy_validity() {
        assert!(HealthPolicy::default().is_valid());
        let bad = HealthPolicy {
            suspect_after_ms: 500,
            down_after_ms: 500,
        };
        assert!(!bad.is_valid());
    }
}
