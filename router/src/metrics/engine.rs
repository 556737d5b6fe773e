//! The engine's families, read at scrape time: the local engine's load or each node's last
//! report (sequences, KV use and tiers, preemptions, speculation), the prefix cache's blocks by
//! tier, and the engine thread's step times.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use strata_engine_api::kv::{KvDump, Tier};
use strata_engine_api::load::{EngineLoad, StepTimes};

use super::{Labels, counters, gauges};

/// Cached KV blocks on each tier, from the engine's dump.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierCounts {
    pub device: u64,
    pub host: u64,
    pub disk: u64,
}

impl TierCounts {
    pub fn of(dump: &KvDump) -> Self {
        let mut counts = Self::default();
        for (_, _, tier) in &dump.blocks {
            match tier {
                Tier::Device => counts.device += 1,
                Tier::Host => counts.host += 1,
                Tier::Disk => counts.disk += 1,
            }
        }
        counts
    }
}

/// What the engine (or the nodes behind a router) reported when `/metrics` was asked.
#[derive(Debug, Default)]
pub struct EngineSnapshot {
    /// The prefix cache's blocks by tier; `None` when the engine could not be asked.
    pub kv: Option<TierCounts>,
    pub step_times: Option<StepTimes>,
    /// The local engine's load (address empty), or each node's last report by address.
    pub loads: Vec<(String, EngineLoad)>,
}

impl Collector for EngineSnapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        if let Some(kv) = self.kv {
            gauges(
                &mut encoder,
                "strata_kv_cached_blocks",
                "KV blocks held by the prefix cache, by tier.",
                [("device", kv.device), ("host", kv.host), ("disk", kv.disk)]
                    .map(|(tier, n)| (vec![("tier", tier.to_string())], n)),
            )?;
        }
        if let Some(times) = &self.step_times {
            step_times(&mut encoder, times)?;
        }
        if !self.loads.is_empty() {
            self.loads(&mut encoder)?;
            self.kv_tiers(&mut encoder)?;
            self.spec_decode(&mut encoder)?;
        }
        Ok(())
    }
}

impl EngineSnapshot {
    /// Each load's labels (`node="ADDR"` for a node's report, none for the local engine) with
    /// `f` of it.
    fn each<V>(&self, f: impl Fn(&EngineLoad) -> V) -> impl Iterator<Item = (Labels, V)> {
        self.loads.iter().map(move |(addr, load)| {
            let labels = if addr.is_empty() {
                Vec::new()
            } else {
                vec![("node", addr.clone())]
            };
            (labels, f(load))
        })
    }

    /// Sequences, KV use and preemptions.
    fn loads(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        gauges(
            e,
            "strata_engine_requests_running",
            "Sequences the engine is running.",
            self.each(|l| l.running),
        )?;
        gauges(
            e,
            "strata_engine_requests_waiting",
            "Sequences waiting in the engine for KV blocks or a running slot.",
            self.each(|l| l.waiting),
        )?;
        gauges(
            e,
            "strata_kv_usage_ratio",
            "Device KV blocks held by running sequences / device KV blocks (0..1).",
            self.each(|l| {
                if l.capacity_blocks == 0 {
                    0.0
                } else {
                    l.active_blocks as f64 / l.capacity_blocks as f64
                }
            }),
        )?;
        counters(
            e,
            "strata_preemptions_total",
            "Sequences preempted when the KV cache ran out (they resume later).",
            self.each(|l| l.preemptions),
        )
    }

    /// Each load's samples by tier: `f` gives a value per tier named.
    fn each_tier<V, const N: usize>(
        &self,
        tiers: [&'static str; N],
        f: impl Fn(&EngineLoad) -> [V; N],
    ) -> Vec<(Labels, V)> {
        self.each(f)
            .flat_map(|(labels, values)| {
                tiers.into_iter().zip(values).map(move |(tier, v)| {
                    let mut labels = labels.clone();
                    labels.push(("tier", tier.to_string()));
                    (labels, v)
                })
            })
            .collect()
    }

    /// The KV tiers: capacity by tier, bytes and time moved between the device and host / disk,
    /// and copies that failed.
    fn kv_tiers(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        gauges(
            e,
            "strata_kv_tier_capacity_blocks",
            "KV blocks each tier holds at most.",
            self.each_tier(["device", "host", "disk"], |l| {
                [
                    l.capacity_blocks,
                    l.host_capacity_blocks,
                    l.disk_capacity_blocks,
                ]
            }),
        )?;
        const LOWER: [&str; 2] = ["host", "disk"];
        counters(
            e,
            "strata_kv_restored_bytes_total",
            "KV bytes copied back to the device from a lower tier.",
            self.each_tier(LOWER, |l| {
                l.restored_blocks.map(|b| b.saturating_mul(l.block_bytes))
            }),
        )?;
        counters(
            e,
            "strata_kv_restore_seconds_total",
            "Engine-thread time restoring KV blocks from a lower tier (reading them, and copying \
             or, from page-locked memory on CUDA, queueing the copy to the device).",
            self.each_tier(LOWER, |l| l.restore_ns.map(|ns| ns as f64 / 1e9)),
        )?;
        counters(
            e,
            "strata_kv_restores_declined_total",
            "Cached lower-tier KV blocks recomputed instead of restored: restoring them was \
             measured to be slower than computing them (--kv-restore auto).",
            self.each_tier(LOWER, |l| l.declined_restores.map(|b| b as f64)),
        )?;
        counters(
            e,
            "strata_kv_demoted_bytes_total",
            "KV bytes written into a lower tier (evicted from the tier above).",
            self.each_tier(LOWER, |l| {
                l.demoted_blocks.map(|b| b.saturating_mul(l.block_bytes))
            }),
        )?;
        counters(
            e,
            "strata_kv_tier_copy_failures_total",
            "Copies between KV tiers that failed (each cost a cached block or one request).",
            self.each(|l| l.tier_copy_failures),
        )
    }

    /// Speculative decoding's counters, in vLLM's `spec_decode_*` families: verifications,
    /// proposed and accepted tokens, and verifications by accepted length (a histogram: bucket
    /// `le` counts those that accepted at most that many). Written only where an engine
    /// speculates.
    fn spec_decode(&self, e: &mut DescriptorEncoder) -> std::fmt::Result {
        if self.loads.iter().all(|(_, l)| l.spec.drafts == 0) {
            return Ok(());
        }
        counters(
            e,
            "strata_spec_decode_num_drafts_total",
            "Verifications run: sequence steps that carried proposed tokens.",
            self.each(|l| l.spec.drafts),
        )?;
        counters(
            e,
            "strata_spec_decode_num_draft_tokens_total",
            "Tokens proposed and verified.",
            self.each(|l| l.spec.draft_tokens),
        )?;
        counters(
            e,
            "strata_spec_decode_num_accepted_tokens_total",
            "Proposed tokens accepted (each a decode step saved).",
            self.each(|l| l.spec.accepted_tokens),
        )?;
        let mut metric = e.encode_descriptor(
            "strata_spec_decode_accepted_length",
            "Proposed tokens accepted per verification.",
            None,
            MetricType::Histogram,
        )?;
        for (labels, spec) in self.each(|l| l.spec) {
            let buckets: Vec<(f64, u64)> = (spec.accepted_hist.iter().enumerate())
                .map(|(len, &n)| (len as f64, n))
                .collect();
            metric
                .encode_family(&labels)?
                .encode_histogram::<NoLabelSet>(
                    spec.accepted_tokens as f64,
                    spec.drafts,
                    &buckets,
                    None,
                )?;
        }
        Ok(())
    }
}

/// The engine thread's steps: how many, the tokens they computed, and their time by phase
/// (docs/PERFORMANCE.md reads a step's host overhead from these).
fn step_times(e: &mut DescriptorEncoder, t: &StepTimes) -> std::fmt::Result {
    counters(
        e,
        "strata_engine_steps_total",
        "Engine steps that computed tokens.",
        [(Vec::new(), t.steps)],
    )?;
    counters(
        e,
        "strata_engine_step_tokens_total",
        "Tokens computed by engine steps (prompt and generated).",
        [(Vec::new(), t.tokens)],
    )?;
    counters(
        e,
        "strata_engine_step_seconds_total",
        "Engine step time by phase: plan (scheduling, KV blocks), forward (the backend, with the \
         copy back to the host), sample (sampling and bookkeeping on the host).",
        [
            ("plan", t.plan_ns),
            ("forward", t.forward_ns),
            ("sample", t.sample_ns),
        ]
        .map(|(phase, ns)| (vec![("phase", phase.to_string())], ns as f64 / 1e9)),
    )
}
