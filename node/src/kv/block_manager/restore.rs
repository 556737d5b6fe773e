//! Restore only when it pays: before a waiting sequence takes its cached prefix, the block
//! manager weighs restoring each lower-tier block (at the rate that tier has measured: its
//! restore time per block so far) against recomputing it (at the engine's measured prefill rate),
//! and keeps the leading run whose restore-then-recompute cost is least. A tier not yet measured
//! counts as free (restoring it is how it gets measured); so does every tier until the engine has
//! timed a prefill. `RestorePolicy::Always` restores every cached block (the previous behaviour,
//! and the canary that must lose where a tier is slower than recomputing).

use super::BlockManager;
use crate::kv::types::{BlockHash, Tier};

/// A lower tier's index in the per-tier counters (`[host, disk]`).
pub(super) fn lower_index(tier: Tier) -> Option<usize> {
    match tier {
        Tier::Device => None,
        Tier::Host => Some(0),
        Tier::Disk => Some(1),
    }
}

/// Whether cached blocks in the host and disk tiers are restored always, or only where restoring
/// is measured to be faster than recomputing them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RestorePolicy {
    #[default]
    Auto,
    Always,
}

impl std::str::FromStr for RestorePolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "always" => Ok(Self::Always),
            other => Err(format!("{other:?}: expected auto or always")),
        }
    }
}

/// The chooser's state: its policy, the engine's compute cost per block, and what it declined.
#[derive(Debug, Default)]
pub(super) struct Chooser {
    policy: RestorePolicy,
    /// Seconds to recompute one block (0 until the engine has measured a prefill).
    compute_s_per_block: f64,
    /// Lower-tier blocks left to be recomputed because restoring them would have been slower,
    /// per tier (`[host, disk]`).
    declined: [u64; 2],
}

impl BlockManager {
    pub fn set_restore_policy(&mut self, policy: RestorePolicy) {
        self.restore.policy = policy;
    }

    /// The engine's measured prefill rate (tokens per second; 0 = not measured).
    pub fn set_compute_rate(&mut self, tokens_per_s: u64) {
        self.restore.compute_s_per_block = if tokens_per_s == 0 {
            0.0
        } else {
            self.block_size as f64 / tokens_per_s as f64
        };
    }

    /// Lower-tier blocks recomputed instead of restored so far, per tier (`[host, disk]`).
    pub fn declined_restores(&self) -> [u64; 2] {
        self.restore.declined
    }

    /// Seconds one block of `tier` has taken to restore so far (0 when none has yet).
    fn restore_s_per_block(&self, tier: usize) -> f64 {
        let t = self.traffic;
        if t.restored[tier] == 0 {
            0.0
        } else {
            t.restore_ns[tier] as f64 * 1e-9 / t.restored[tier] as f64
        }
    }

    /// How many leading blocks of `hashes` to take from the cache: the device run, then the
    /// lower-tier blocks after it up to the cut where restoring them and recomputing the rest
    /// costs least (ties restore more).
    pub(super) fn restore_cut(&mut self, hashes: &[BlockHash]) -> usize {
        let found = self.lookup(hashes);
        let c = self.restore.compute_s_per_block;
        if self.restore.policy == RestorePolicy::Always || c == 0.0 || found.lower == 0 {
            return found.device + found.lower;
        }
        let tiers: Vec<usize> = hashes[found.device..found.device + found.lower]
            .iter()
            .map(|h| {
                self.index
                    .get(h)
                    .and_then(|e| lower_index(e.location.tier()))
                    .unwrap_or(0)
            })
            .collect();
        let per_tier = [self.restore_s_per_block(0), self.restore_s_per_block(1)];
        let (mut best, mut best_cost) = (0, found.lower as f64 * c);
        let mut restored = 0.0;
        for (k, &tier) in tiers.iter().enumerate() {
            restored += per_tier[tier];
            let cost = restored + (found.lower - k - 1) as f64 * c;
            if cost <= best_cost {
                (best, best_cost) = (k + 1, cost);
            }
        }
        for &tier in &tiers[best..] {
            self.restore.declined[tier] += 1;
        }
        found.device + best
    }
}
