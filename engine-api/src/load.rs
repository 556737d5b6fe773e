//! An engine's load as a router reads it: requests queued and running, KV blocks by tier, the
//! rates its cost models take, speculation's counters; and the engine thread's step times.

use serde::{Deserialize, Serialize};

/// The most tokens one verification may propose per sequence: the draft lengths the
/// byte-identity gate covers (docs/TESTING.md, `run-spec`).
pub const MAX_SPECULATIVE_TOKENS: usize = 8;

/// A node's load: requests queued and running, prompt tokens not yet prefilled, KV blocks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineLoad {
    pub waiting: u64,
    pub running: u64,
    /// Prompt tokens admitted but not yet prefilled (queued and partially prefilled requests).
    pub queued_prefill_tokens: u64,
    /// Device KV blocks held by running sequences.
    pub active_blocks: u64,
    /// Device KV blocks in all.
    pub capacity_blocks: u64,
    /// Tokens per second the engine computes in steps of at least
    /// `RATE_SAMPLE_TOKENS` tokens (prefill-heavy steps; strata-node), a moving average;
    /// 0 until such a step ran. What a router's fetch cost model takes as the prefill rate.
    #[serde(default)]
    pub tokens_per_s: u64,
    /// Bytes per second this node's cross-node KV fetches achieved, a moving average (filled by
    /// the node service; 0 until a fetch ran).
    #[serde(default)]
    pub fetch_bytes_per_s: u64,
    /// Sequences preempted so far (their blocks released when the cache ran out; they resume
    /// later).
    #[serde(default)]
    pub preemptions: u64,
    /// Capacity of the host and disk KV tiers in blocks (0 where there is none).
    #[serde(default)]
    pub host_capacity_blocks: u64,
    #[serde(default)]
    pub disk_capacity_blocks: u64,
    /// Bytes of one KV block (what the tiers' block counts are in).
    #[serde(default)]
    pub block_bytes: u64,
    /// Blocks restored to the device from host and disk, the time that took, and blocks
    /// demoted into host and disk, so far.
    #[serde(default)]
    pub restored_blocks: [u64; 2],
    #[serde(default)]
    pub restore_ns: [u64; 2],
    #[serde(default)]
    pub demoted_blocks: [u64; 2],
    /// Cached host and disk blocks recomputed instead, because restoring them was measured to
    /// be slower (`--kv-restore auto`).
    #[serde(default)]
    pub declined_restores: [u64; 2],
    /// Copies between tiers that failed (each cost a cached block or one request).
    #[serde(default)]
    pub tier_copy_failures: u64,
    /// Cached blocks on the device (held by no sequence), on the host tier and on the disk tier.
    #[serde(default)]
    pub cached_blocks: [u64; 3],
    /// Device blocks only pins hold, which no request can have while there is no lower tier
    /// (`BlockManager::held_by_pins`): a prompt is admitted against the capacity less these.
    #[serde(default)]
    pub pinned_blocks: u64,
    /// Speculative decoding's proposals and acceptances so far (zero without speculation).
    #[serde(default)]
    pub spec: SpecCounters,
}

/// Where the engine thread's steps spent their time, summed over every step that computed
/// something: planning (expiry, admission, block allocation, prefix lookups), the backend's
/// forward pass (with the copy of logits or sampled tokens back to the host), and sampling and
/// bookkeeping on the host (penalties, grammar, events, finished sequences).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepTimes {
    pub steps: u64,
    /// Tokens computed (prompt and generated).
    pub tokens: u64,
    pub plan_ns: u64,
    pub forward_ns: u64,
    pub sample_ns: u64,
}

/// Speculation's counters since the engine started (vLLM's `spec_decode_*` families).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecCounters {
    /// Verifications run (sequences whose step carried at least one proposal).
    pub drafts: u64,
    /// Tokens proposed and verified.
    pub draft_tokens: u64,
    /// Proposed tokens accepted (each one a step saved).
    pub accepted_tokens: u64,
    /// Verifications by how many of their proposals were accepted (0..=k).
    pub accepted_hist: [u64; MAX_SPECULATIVE_TOKENS + 1],
}

impl SpecCounters {
    pub fn record(&mut self, proposed: usize, accepted: usize) {
        self.drafts += 1;
        self.draft_tokens += proposed as u64;
        self.accepted_tokens += accepted as u64;
        self.accepted_hist[accepted.min(MAX_SPECULATIVE_TOKENS)] += 1;
    }

    /// Accepted ÷ proposed (0 before any proposal).
    pub fn acceptance_rate(&self) -> f64 {
        if self.draft_tokens == 0 {
            0.0
        } else {
            self.accepted_tokens as f64 / self.draft_tokens as f64
        }
    }

    /// The acceptance a sequence not yet verified is expected to have: accepted ÷ proposed
    /// smoothed by one accepted and one rejected (1/2 before any proposal).
    pub fn prior(&self) -> f64 {
        (self.accepted_tokens as f64 + 1.0) / (self.draft_tokens as f64 + 2.0)
    }

    /// Tokens committed per verification, the bonus or corrected token included.
    pub fn mean_accepted_len(&self) -> f64 {
        if self.drafts == 0 {
            0.0
        } else {
            1.0 + self.accepted_tokens as f64 / self.drafts as f64
        }
    }
}
