//! Cross-node KV fetch (DESIGN.md §6): when the node a request goes to lacks prompt blocks
//! another node has cached, it may import them from there instead of computing them. Worth it
//! when moving the bytes is faster than the prefill they save:
//!
//! `fetch_overhead_s + blocks × block_bytes / link_bytes_per_s`
//! `< blocks × block_size / prefill_tokens_per_s`.
//!
//! The rates are configuration, replaced by what the chosen node measured of itself once it has
//! (its compute rate in prefill-heavy steps, the throughput of its past fetches; reported with
//! its load); the defaults and the measurements behind them are in docs/PERFORMANCE.md
//! ("Cross-node KV fetch").

use serde::{Deserialize, Serialize};

/// The cost model's parameters (router configuration, `[kv_fetch]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvFetchConfig {
    pub enabled: bool,
    /// Bytes per second one fetch moves between two nodes.
    pub link_bytes_per_s: f64,
    /// Fixed cost of a fetch, seconds: connection reuse, the exporter's copy, a round trip.
    pub fetch_overhead_s: f64,
    /// Prompt tokens per second a node computes.
    pub prefill_tokens_per_s: f64,
    /// Fewest blocks worth a fetch.
    pub min_blocks: u32,
    /// Take a node's own measured rates over `link_bytes_per_s` and `prefill_tokens_per_s`
    /// once it reports them.
    pub measured_rates: bool,
}

/// Rates a node measured of itself; 0 = not measured yet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MeasuredRates {
    pub tokens_per_s: u64,
    pub fetch_bytes_per_s: u64,
}

impl Default for KvFetchConfig {
    fn default() -> Self {
        // Priors until a node has measured itself (docs/PERFORMANCE.md, "Cross-node KV
        // fetch"): a 100 Gb/s link, so that a first fetch happens and is measured; the H200's
        // prefill rate on the Llama-3.1-8B shape (30 469 tokens/s at 512 tokens,
        // docs/receipts/cuda-battery-h200.json).
        Self {
            enabled: true,
            link_bytes_per_s: 12.5e9,
            fetch_overhead_s: 0.002,
            prefill_tokens_per_s: 30_000.0,
            min_blocks: 2,
            measured_rates: true,
        }
    }
}

impl KvFetchConfig {
    /// These parameters with `measured`'s rates in place of the configured ones (where measured,
    /// and if `measured_rates` allows).
    pub fn with_measured(&self, measured: MeasuredRates) -> Self {
        let mut out = self.clone();
        if self.measured_rates {
            if measured.tokens_per_s > 0 {
                out.prefill_tokens_per_s = measured.tokens_per_s as f64;
            }
            if measured.fetch_bytes_per_s > 0 {
                out.link_bytes_per_s = measured.fetch_bytes_per_s as f64;
            }
        }
        out
    }

    /// Seconds to fetch `blocks` blocks of `block_bytes`.
    pub fn fetch_seconds(&self, blocks: u32, block_bytes: usize) -> f64 {
        self.fetch_overhead_s + f64::from(blocks) * block_bytes as f64 / self.link_bytes_per_s
    }

    /// Seconds to compute `blocks` blocks of `block_size` tokens.
    pub fn compute_seconds(&self, blocks: u32, block_size: usize) -> f64 {
        f64::from(blocks) * block_size as f64 / self.prefill_tokens_per_s
    }

    /// The blocks `from..to` to fetch for a request whose chosen node holds its first `here`
    /// blocks while another holds its first `there`; `None` when fetching does not pay.
    pub fn plan(
        &self,
        here: u32,
        there: u32,
        block_bytes: usize,
        block_size: usize,
    ) -> Option<(u32, u32)> {
        let blocks = there.checked_sub(here)?;
        let worth = self.enabled
            && blocks >= self.min_blocks.max(1)
            && self.fetch_seconds(blocks, block_bytes) < self.compute_seconds(blocks, block_size);
        worth.then_some((here, there))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama-3.1-8B in bf16: 32 layers × K and V × 8 KV heads × 128 × 16 tokens × 2 bytes.
    const BLOCK_8B: usize = 32 * 2 * 8 * 128 * 16 * 2;

    #[test]
    fn fetches_when_moving_bytes_beats_computing_them() {
        let fast_link = KvFetchConfig {
            link_bytes_per_s: 50e9,
            prefill_tokens_per_s: 10_000.0,
            ..KvFetchConfig::default()
        };
        // 100 blocks: 4.2 ms to move (+2 ms), 160 ms to compute.
        assert_eq!(fast_link.plan(3, 103, BLOCK_8B, 16), Some((3, 103)));
        // Canary arms: each must refuse.
        let slow_link = KvFetchConfig {
            link_bytes_per_s: 1e9,
            ..fast_link.clone()
        };
        assert_eq!(
            slow_link.plan(3, 103, BLOCK_8B, 16),
            None,
            "210 ms > 160 ms"
        );
        assert_eq!(fast_link.plan(3, 4, BLOCK_8B, 16), None, "under min_blocks");
        assert_eq!(fast_link.plan(5, 4, BLOCK_8B, 16), None, "nothing to fetch");
        let off = KvFetchConfig {
            enabled: false,
            ..fast_link.clone()
        };
        assert_eq!(off.plan(0, 100, BLOCK_8B, 16), None);
        // The fixed overhead dominates a short run: one block computes in 1.6 ms.
        let any = KvFetchConfig {
            min_blocks: 1,
            ..fast_link
        };
        assert!(any.fetch_seconds(1, BLOCK_8B) > any.compute_seconds(1, 16));
        assert_eq!(any.plan(0, 1, BLOCK_8B, 16), None);
        assert_eq!(any.plan(0, 2, BLOCK_8B, 16), Some((0, 2)));
    }

    #[test]
    fn measured_rates_replace_the_configured_ones() {
        let config = KvFetchConfig::default();
        let measured = MeasuredRates {
            tokens_per_s: 1_000,
            fetch_bytes_per_s: 0,
        };
        let used = config.with_measured(measured);
        assert_eq!(used.prefill_tokens_per_s, 1_000.0);
        assert_eq!(
            used.link_bytes_per_s, config.link_bytes_per_s,
            "not measured yet"
        );
        // A slow measured link turns a fetch the defaults would make into a computation.
        assert_eq!(config.plan(0, 100, BLOCK_8B, 16), Some((0, 100)));
        let slow = config.with_measured(MeasuredRates {
            tokens_per_s: 30_000,
            fetch_bytes_per_s: 100_000_000,
        });
        assert_eq!(slow.plan(0, 100, BLOCK_8B, 16), None);
        let fast = config.with_measured(MeasuredRates {
            tokens_per_s: 30_000,
            fetch_bytes_per_s: 40_000_000_000,
        });
        assert_eq!(fast.plan(0, 100, BLOCK_8B, 16), Some((0, 100)));
        let fixed = KvFetchConfig {
            measured_rates: false,
            ..config.clone()
        };
        assert_eq!(fixed.with_measured(measured), fixed);
    }

    #[test]
    fn config_reads_partial_toml() {
        let c: KvFetchConfig = toml::from_str("link_bytes_per_s = 2.5e10\nmin_blocks = 8").unwrap();
        assert_eq!(c.link_bytes_per_s, 2.5e10);
        assert_eq!(c.min_blocks, 8);
        assert!(c.enabled);
        assert!(
            toml::from_str::<KvFetchConfig>("link = 1").is_err(),
            "unknown keys refused"
        );
    }
}
