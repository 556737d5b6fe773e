//! Router microbenchmark (issue 8's bar: event ingest above 10 M events/s with p99 under 10 µs;
//! routing decisions with 64 nodes and 1 M indexed blocks): the prefix index fed by KV events,
//! then the cache-aware policy choosing among 64 loaded nodes for 2048-token prompts.
//!
//! Prints one JSON object to stdout (`scripts/bench/router.sh` turns it into a receipt, adding
//! the machine).
//! Single-threaded: one router core. Figures are min / median / max over `REPS` repetitions.

use std::hint::black_box;
use std::time::Instant;

use serde_json::{Value, json};
use strata_node::kv::{BlockHash, KvEvent, KvEventKind, Tier};
use strata_router::routing::{
    Candidate, NodeLoad, Policy, PrefixIndex, Router, Slot, VNODES_PER_GPU,
};

const REPS: usize = 5;
const NODES: usize = 64;
/// Documents (shared prefixes) and their length in blocks: 8192 × 128 = 1 M distinct blocks.
const DOCS: usize = 8192;
const DOC_BLOCKS: usize = 128;
/// Nodes holding each document.
const COPIES: usize = 2;
/// Blocks per routed request (2048 tokens at 16 per block).
const REQUEST_BLOCKS: usize = 128;
const REQUESTS: usize = 100_000;
const BLOCK_SIZE: usize = 16;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Block `b` of document `d`: distinct 128-bit values, as the chained xxh3 hashes are.
fn block(d: usize, b: usize) -> BlockHash {
    let mut r = Rng(((d as u64) << 20) ^ b as u64);
    BlockHash((u128::from(r.next()) << 64) | u128::from(r.next()))
}

fn stats(mut xs: Vec<f64>) -> Value {
    xs.sort_by(f64::total_cmp);
    json!({"min": xs[0], "median": xs[xs.len() / 2], "max": xs[xs.len() - 1]})
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

/// Every document stored on `COPIES` nodes, as the nodes' event streams deliver it.
fn events() -> Vec<(usize, KvEvent)> {
    let mut rng = Rng(7);
    let mut seq = vec![0u64; NODES];
    let mut out = Vec::with_capacity(DOCS * DOC_BLOCKS * COPIES);
    for d in 0..DOCS {
        let first = rng.below(NODES);
        for c in 0..COPIES {
            let node = (first + c * (NODES / COPIES)) % NODES;
            for b in 0..DOC_BLOCKS {
                seq[node] += 1;
                let tier = match rng.below(10) {
                    0 => Tier::Disk,
                    1 | 2 => Tier::Host,
                    _ => Tier::Device,
                };
                out.push((
                    node,
                    KvEvent {
                        seq: seq[node],
                        kind: KvEventKind::Stored {
                            hash: block(d, b),
                            parent: None,
                            tier,
                        },
                    },
                ));
            }
        }
    }
    out
}

fn fresh_index() -> (PrefixIndex, Vec<Slot>) {
    let mut index = PrefixIndex::with_capacity(DOCS * DOC_BLOCKS);
    let slots = (0..NODES)
        .map(|_| index.add_node().expect("64 nodes fit"))
        .collect();
    (index, slots)
}

fn ingest(events: &[(usize, KvEvent)]) -> (Value, PrefixIndex, Vec<Slot>) {
    let mut rates = Vec::new();
    let mut latencies = Vec::new();
    let mut kept = None;
    for rep in 0..REPS {
        let (mut index, slots) = fresh_index();
        if rep == 0 {
            // Per-event latency, each event timed alone (the timer's own cost included).
            for (node, event) in events {
                let start = Instant::now();
                index.apply(slots[*node], event).expect("events in order");
                latencies.push(start.elapsed().as_nanos() as u64);
            }
        } else {
            let start = Instant::now();
            for (node, event) in events {
                index.apply(slots[*node], event).expect("events in order");
            }
            rates.push(events.len() as f64 / start.elapsed().as_secs_f64());
        }
        black_box(index.len());
        kept = Some((index, slots));
    }
    latencies.sort_unstable();
    let (index, slots) = kept.expect("REPS > 0");
    let value = json!({
        "events": events.len(),
        "indexed_blocks": index.len(),
        "nodes": NODES,
        "events_per_s": stats(rates),
        "event_latency_ns": {
            "p50": percentile(&latencies, 0.5),
            "p99": percentile(&latencies, 0.99),
            "p999": percentile(&latencies, 0.999),
            "max": latencies[latencies.len() - 1],
        },
    });
    (value, index, slots)
}

fn routing(index: &PrefixIndex, slots: &[Slot]) -> Value {
    let mut rng = Rng(11);
    let nodes: Vec<Candidate> = slots
        .iter()
        .map(|&slot| Candidate {
            slot,
            ring_id: rng.next(),
            vnodes: VNODES_PER_GPU,
            load: NodeLoad {
                queued_prefill_tokens: rng.below(8192) as u64,
                active_blocks: rng.below(6000) as u64,
                capacity_blocks: 8000,
            },
        })
        .collect();
    // Requests: a cached document's prefix of random length, then blocks nobody holds.
    let requests: Vec<Vec<BlockHash>> = (0..REQUESTS)
        .map(|i| {
            let d = rng.below(DOCS);
            let cached = rng.below(DOC_BLOCKS + 1);
            (0..REQUEST_BLOCKS)
                .map(|b| {
                    if b < cached {
                        block(d, b)
                    } else {
                        block(DOCS + i, b)
                    }
                })
                .collect()
        })
        .collect();
    let mut router = Router::new(Policy::default());
    let mut latencies = Vec::with_capacity(REQUESTS);
    let mut per_s = Vec::new();
    let mut cached_blocks = 0u64;
    for rep in 0..REPS {
        let start = Instant::now();
        for req in &requests {
            let t = Instant::now();
            let d = router
                .route(index, &nodes, req, req[0].0, BLOCK_SIZE)
                .expect("candidates");
            if rep == 0 {
                latencies.push(t.elapsed().as_nanos() as u64);
                cached_blocks += u64::from(d.cached_blocks);
            }
            black_box(d);
        }
        per_s.push(REQUESTS as f64 / start.elapsed().as_secs_f64());
    }
    latencies.sort_unstable();
    json!({
        "requests": REQUESTS,
        "request_blocks": REQUEST_BLOCKS,
        "candidates": NODES,
        "indexed_blocks": index.len(),
        "mean_cached_blocks_of_chosen_node": cached_blocks as f64 / REQUESTS as f64,
        "decision_ns": {
            "p50": percentile(&latencies, 0.5),
            "p99": percentile(&latencies, 0.99),
            "max": latencies[latencies.len() - 1],
        },
        "decisions_per_s": stats(per_s),
    })
}

fn main() {
    let events = events();
    let (ingest, index, slots) = ingest(&events);
    let report = json!({
        "bench": "routing",
        "ingest": ingest,
        "routing": routing(&index, &slots),
    });
    println!(
        "{}",
        serde_json::to_string_pretty(&report).expect("JSON of plain values")
    );
}
