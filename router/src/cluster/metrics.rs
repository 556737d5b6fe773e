//! The routing families of `/metrics`: decisions by reason, requests per node, each node's
//! measured rates, the ring epoch, prompt blocks found cached where they were sent, failovers
//! and cross-node KV fetches. Read from the cluster when `/metrics` is asked.

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use super::Cluster;
use crate::metrics::{Labels, counters, gauges};
use crate::routing::MeasuredRates;

/// The cluster's routing families, as a collector for one scrape.
pub struct RoutingMetrics(pub Arc<Cluster>);

impl std::fmt::Debug for RoutingMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RoutingMetrics")
    }
}

impl Collector for RoutingMetrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let cluster = &self.0;
        let s = &cluster.stats;
        let e = &mut encoder;
        let no_labels =
            |n: &std::sync::atomic::AtomicU64| [(Labels::new(), n.load(Ordering::Relaxed))];
        counters(
            e,
            "strata_router_decisions_total",
            "Routing decisions by reason.",
            [("cache", &s.cache), ("ring", &s.ring), ("other", &s.other)].map(|(reason, n)| {
                (
                    vec![("reason", reason.to_string())],
                    n.load(Ordering::Relaxed),
                )
            }),
        )?;
        counters(
            e,
            "strata_router_node_requests_total",
            "Requests sent to each node.",
            cluster
                .routed()
                .into_iter()
                .map(|(addr, n)| (vec![("node", addr.to_string())], n)),
        )?;
        type Rate = fn(&MeasuredRates) -> u64;
        let rates: [(&str, &str, Rate); 2] = [
            (
                "strata_router_node_tokens_per_second",
                "Tokens per second each node's prefill-heavy steps compute (its report).",
                |r| r.tokens_per_s,
            ),
            (
                "strata_router_node_fetch_bytes_per_second",
                "Bytes per second each node's cross-node KV fetches achieved (its report).",
                |r| r.fetch_bytes_per_s,
            ),
        ];
        let nodes = cluster.nodes();
        for (name, help, rate) in rates {
            let samples = nodes.iter().map(|node| {
                let rates = *node.rates.lock().unwrap_or_else(PoisonError::into_inner);
                (vec![("node", node.addr.to_string())], rate(&rates))
            });
            gauges(e, name, help, samples)?;
        }
        gauges(
            e,
            "strata_router_ring_epoch",
            "The topology group's ownership ring epoch.",
            no_labels(&cluster.ring_epoch),
        )?;
        for (name, help, value) in [
            (
                "strata_router_prompt_blocks_total",
                "Full prompt blocks of routed requests.",
                &s.prompt_blocks,
            ),
            (
                "strata_router_cached_blocks_total",
                "Of those, blocks cached on the node chosen.",
                &s.cached_blocks,
            ),
            (
                "strata_router_failovers_total",
                "Requests continued on another node after theirs failed.",
                &s.failovers,
            ),
            (
                "strata_router_busy_refusals_total",
                "Generate calls nodes refused at their admission limit (tried elsewhere).",
                &s.busy_refusals,
            ),
            (
                "strata_router_kv_fetches_total",
                "Requests sent with a cross-node KV fetch.",
                &s.kv_fetches,
            ),
            (
                "strata_router_kv_fetch_blocks_total",
                "Prompt blocks those fetches named.",
                &s.kv_fetch_blocks,
            ),
        ] {
            counters(e, name, help, no_labels(value))?;
        }
        Ok(())
    }
}
