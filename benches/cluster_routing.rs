//! Cache-aware routing against round-robin and least-loaded, with real processes on 127.0.0.1:
//! three `strata node serve` (CPU engines, each with room for about a third of the tenants'
//! prefixes) and two `strata router`s in front of them, active-active, clients alternating
//! between the routers.
//!
//! The workload is multi-tenant with long shared prefixes: every request is one tenant's system
//! prompt (64 blocks) followed by a question of its own, streamed, a few at a time. A router that
//! keeps each tenant on the node caching its prefix prefills only the question; one that spreads
//! tenants over every node makes each node hold every prefix, which its cache cannot, and
//! recomputes them. Each policy runs on fresh nodes, with cross-node KV fetch (a node imports
//! the prefix from the node caching it when that beats computing it) and without. Reported per
//! arm: the time to first token (p50, p99) as the clients see it, the share of prompt tokens the
//! nodes found cached (from each response's usage) against the best any router can reach (every
//! request but each tenant's first hits its prefix), what the routers expected when they chose,
//! the fetches they asked for, and the ratio of each arm's TTFT to cache-aware's.
//!
//! A last phase isolates the fetch: two idle nodes, one request at a time; a tenant's prompt is
//! computed on one node, then the same prompt goes to the other, which fetches the prefix
//! (64 blocks, 8 MiB) or, without fetching, computes it again. Reported: both TTFTs and the rates
//! they imply (prefill tokens/s, fetched bytes/s), the inputs of the fetch cost model.
//!
//! `cargo bench --bench cluster_routing` prints one JSON object on stdout (progress on stderr);
//! `STRATA_ROUTING_ROUNDS` sets the requests per tenant (default 8).

#[path = "../tests/cluster/mod.rs"]
mod cluster;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use cluster::{Process, get, metric, stream_timed};
use serde_json::{Value, json};
use strata_topology::transport::ClusterCa;

const NODES: usize = 3;
const TENANTS: usize = 9;
/// Tokens of a tenant's shared prefix (64 blocks of 16).
const PREFIX_TOKENS: usize = 1024;
/// Tokens of each request's own question.
const QUESTION_TOKENS: usize = 16;
/// A node's KV cache: room for about four tenants' prefixes (a block of this model is 4 layers ×
/// K and V × 16 tokens × 256 floats × 4 bytes = 128 KiB; a prefix is 64 blocks, 8 MiB).
const NODE_KV_MIB: usize = 36;
/// Clients sending at once.
const CLIENTS: usize = 3;
const MAX_TOKENS: u32 = 4;

fn synth(dir: &Path) -> Result<()> {
    let out = cluster::strata(&[
        "model",
        "synth",
        "--arch",
        "llama",
        "--out",
        dir.to_str().context("path")?,
        "--layers",
        "4",
        "--hidden",
        "256",
        "--heads",
        "4",
        "--kv-heads",
        "4",
        "--intermediate",
        "1024",
        "--max-position",
        "4096",
    ]);
    ensure!(out.status.success(), "synth failed: {out:?}");
    Ok(())
}

/// The prompt of `tenant`'s request `round`, as token ids (the completions API takes them as
/// they are): its shared prefix of [`PREFIX_TOKENS`], then a question of its own (one block).
fn prompt(tenant: usize, round: usize) -> Vec<u32> {
    let prefix = (0..PREFIX_TOKENS).map(|i| ((tenant * 7919 + i * 31) % 250 + 3) as u32);
    let question =
        (0..QUESTION_TOKENS).map(|i| ((round * 131 + tenant * 17 + i * 7) % 250 + 3) as u32);
    prefix.chain(question).collect()
}

struct Arm {
    name: &'static str,
    ttft: Vec<Duration>,
    /// Summed over the requests' usage: what the nodes computed and found cached.
    prompt_tokens: f64,
    cached_tokens: f64,
    prompt_blocks: f64,
    cached_blocks: f64,
    decisions: Value,
    kv_fetches: f64,
}

/// What every node and router of the bench shares: the model, the CA, a directory.
struct Env<'a> {
    model: &'a Path,
    ca: &'a ClusterCa,
    dir: &'a Path,
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

/// `count` nodes with member certificates from `ca` (identities under `dir`, named by `arm`).
fn start_nodes(arm: &str, count: usize, env: &Env<'_>) -> Result<(Vec<Process>, Vec<SocketAddr>)> {
    let mut nodes = Vec::new();
    let mut addrs = Vec::new();
    for id in 1..=count as u64 {
        let identity = env.dir.join(format!("{arm}-member-{id}"));
        env.ca.issue_member(id, &identity)?;
        let node = Process::start(&[
            "node",
            "serve",
            "--model",
            env.model.to_str().context("path")?,
            "--listen",
            "127.0.0.1:0",
            "--identity",
            identity.to_str().context("path")?,
            "--kv-cache-mib",
            &NODE_KV_MIB.to_string(),
        ]);
        addrs.push(node.address("on quic://"));
        nodes.push(node);
    }
    Ok((nodes, addrs))
}

/// `count` routers over `nodes` with `policy`, fetching KV across nodes or not.
fn start_routers(
    arm: &str,
    count: usize,
    nodes: &[SocketAddr],
    policy: &str,
    fetch: bool,
    env: &Env<'_>,
) -> Result<(Vec<Process>, Vec<SocketAddr>)> {
    let list: Vec<String> = nodes.iter().map(|a| a.to_string()).collect();
    let operator = env.dir.join(format!("{arm}-router"));
    env.ca.issue_operator("bench-router", &operator)?;
    let mut routers = Vec::new();
    let mut addrs: Vec<SocketAddr> = Vec::new();
    for _ in 0..count {
        let router = Process::start(&[
            "router",
            "--model",
            env.model.to_str().context("path")?,
            "--nodes",
            &list.join(","),
            "--identity",
            operator.to_str().context("path")?,
            "--policy",
            policy,
            "--kv-fetch",
            if fetch { "true" } else { "false" },
            "--port",
            "0",
        ]);
        addrs.push(router.address("on http://"));
        routers.push(router);
    }
    Ok((routers, addrs))
}

fn stream_body(prompt: Vec<u32>) -> String {
    json!({
        "model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS,
        "temperature": 0, "ignore_eos": true, "stream": true,
        "stream_options": {"include_usage": true},
    })
    .to_string()
}

/// One arm (a policy, with or without fetching) on fresh nodes: what its clients and routers
/// saw.
fn run_arm(
    name: &'static str,
    (policy, fetch): (&str, bool),
    env: &Env<'_>,
    rounds: usize,
) -> Result<Arm> {
    let arm = name.replace([' ', ','], "-");
    let (nodes, addrs) = start_nodes(&arm, NODES, env)?;
    let (routers, router_addrs) = start_routers(&arm, 2, &addrs, policy, fetch, env)?;
    // Requests in rounds: every tenant once per round, in a shuffled but fixed order.
    let mut work: Vec<(usize, usize)> = (0..rounds)
        .flat_map(|r| (0..TENANTS).map(move |t| (t, r)))
        .collect();
    work.sort_by_key(|&(t, r)| (r, (t * 7 + r * 3) % TENANTS));
    let queue = Arc::new(Mutex::new(work.into_iter().enumerate().collect::<Vec<_>>()));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let queue = Arc::clone(&queue);
            let seen = Arc::clone(&seen);
            let router_addrs = router_addrs.clone();
            std::thread::spawn(move || {
                loop {
                    let next = queue.lock().unwrap_or_else(PoisonError::into_inner).pop();
                    let Some((i, (tenant, round))) = next else {
                        return;
                    };
                    let body = stream_body(prompt(tenant, round));
                    // Active-active: alternate between the routers.
                    let timed = stream_timed(router_addrs[i % router_addrs.len()], &body);
                    let (prompt, cached) = timed.prompt_tokens.unwrap_or((0, 0));
                    seen.lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push((timed.ttft, prompt, cached));
                }
            })
        })
        .collect();
    for client in clients {
        client
            .join()
            .map_err(|_| anyhow::anyhow!("a client panicked"))?;
    }
    let mut prompt_blocks = 0.0;
    let mut cached_blocks = 0.0;
    let mut decisions = json!({});
    let mut kv_fetches = 0.0;
    for addr in &router_addrs {
        let m = get(*addr, "/metrics");
        kv_fetches += metric(&m, "strata_router_kv_fetches_total");
        prompt_blocks += metric(&m, "strata_router_prompt_blocks_total");
        cached_blocks += metric(&m, "strata_router_cached_blocks_total");
        for reason in ["cache", "ring", "other"] {
            let n = metric(
                &m,
                &format!("strata_router_decisions_total{{reason=\"{reason}\"}}"),
            );
            let total = decisions[reason].as_f64().unwrap_or(0.0) + n;
            decisions[reason] = json!(total);
        }
    }
    let seen = std::mem::take(&mut *seen.lock().unwrap_or_else(PoisonError::into_inner));
    let ttft = seen.iter().map(|s| s.0).collect();
    let prompt_tokens = seen.iter().map(|s| s.1).sum::<u64>() as f64;
    let cached_tokens = seen.iter().map(|s| s.2).sum::<u64>() as f64;
    drop(routers);
    drop(nodes);
    Ok(Arm {
        name,
        ttft,
        prompt_tokens,
        cached_tokens,
        prompt_blocks,
        cached_blocks,
        decisions,
        kv_fetches,
    })
}

/// The fetch alone: per tenant, its prompt computed on one idle node, then sent to the other
/// (round-robin), which fetches the prefix or computes it. Returns the first and second TTFTs
/// and the rates the nodes measured of themselves (per node: tokens/s, fetch bytes/s).
fn fetch_phase(fetch: bool, env: &Env<'_>) -> Result<(Vec<Duration>, Vec<Duration>, Value)> {
    let arm = if fetch { "fetch" } else { "compute" };
    let (nodes, addrs) = start_nodes(arm, 2, env)?;
    let (routers, router) = start_routers(arm, 1, &addrs, "round-robin", fetch, env)?;
    let (mut first, mut second) = (Vec::new(), Vec::new());
    for tenant in 0..TENANTS {
        let body = stream_body(prompt(tenant, 0));
        first.push(stream_timed(router[0], &body).ttft);
        // Let the first node's KV events reach the router.
        std::thread::sleep(Duration::from_millis(500));
        let timed = stream_timed(router[0], &body);
        let (prompt, cached) = timed.prompt_tokens.unwrap_or((0, 0));
        ensure!(
            !fetch || cached + 16 >= prompt,
            "tenant {tenant}: the second node found {cached} of {prompt} tokens cached"
        );
        second.push(timed.ttft);
    }
    // Let a load report carry the last measurements.
    std::thread::sleep(Duration::from_millis(300));
    let m = get(router[0], "/metrics");
    let rates: Vec<Value> = addrs
        .iter()
        .map(|a| {
            json!({
                "tokens_per_s": metric(&m, &format!("strata_router_node_tokens_per_second{{node=\"{a}\"}}")),
                "fetch_bytes_per_s": metric(&m, &format!("strata_router_node_fetch_bytes_per_second{{node=\"{a}\"}}")),
            })
        })
        .collect();
    drop(routers);
    drop(nodes);
    Ok((first, second, json!(rates)))
}

fn main() -> Result<()> {
    let rounds: usize = std::env::var("STRATA_ROUTING_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    let tmp = tempfile::tempdir()?;
    let model = tmp.path().join("m");
    synth(&model)?;
    let ca = ClusterCa::create(&tmp.path().join("ca"))?;
    let env = Env {
        model: &model,
        ca: &ca,
        dir: tmp.path(),
    };
    let mut arms = Vec::new();
    for (name, how) in [
        ("cache-aware", ("cache-aware", true)),
        ("cache-aware, no fetch", ("cache-aware", false)),
        ("round-robin", ("round-robin", false)),
        ("round-robin + fetch", ("round-robin", true)),
        ("least-loaded", ("least-loaded", false)),
        ("least-loaded + fetch", ("least-loaded", true)),
    ] {
        eprintln!("{name}: {TENANTS} tenants × {rounds} rounds on {NODES} nodes, 2 routers");
        let mut arm = run_arm(name, how, &env, rounds)?;
        arm.ttft.sort_unstable();
        eprintln!(
            "{name}: TTFT p50 {:.1} ms, p99 {:.1} ms, cached prompt ratio {:.3}",
            percentile(&arm.ttft, 0.5),
            percentile(&arm.ttft, 0.99),
            arm.cached_tokens / arm.prompt_tokens
        );
        arms.push(arm);
    }
    // The best hit ratio: each tenant's first request misses, every later one hits its prefix's
    // 64 blocks (the question's block never hits).
    let blocks_per_request = arms[0].prompt_blocks / (TENANTS * rounds) as f64;
    let ideal =
        (rounds - 1) as f64 / rounds as f64 * (PREFIX_TOKENS / 16) as f64 / blocks_per_request;
    let report: Vec<Value> = arms
        .iter()
        .map(|a| {
            json!({
                "arm": a.name,
                "requests": a.ttft.len(),
                "ttft_ms": {"p50": percentile(&a.ttft, 0.5), "p99": percentile(&a.ttft, 0.99)},
                // As the nodes report it (usage.prompt_tokens_details.cached_tokens).
                "cached_prompt_ratio": a.cached_tokens / a.prompt_tokens,
                "cached_prompt_ratio_of_ideal": a.cached_tokens / a.prompt_tokens / ideal,
                // As the routers expected it when they chose the node.
                "router_expected_hit_ratio": a.cached_blocks / a.prompt_blocks,
                "decisions": a.decisions,
                "kv_fetches": a.kv_fetches,
                "ttft_p50_over_cache_aware": percentile(&a.ttft, 0.5) / percentile(&arms[0].ttft, 0.5),
            })
        })
        .collect();
    let p50 = |a: &Arm| percentile(&a.ttft, 0.5);
    let p99 = |a: &Arm| percentile(&a.ttft, 0.99);
    eprintln!("fetch phase: {TENANTS} prompts computed on one node, then sent to the other");
    let (mut computed, mut fetched, fetch_rates) = fetch_phase(true, &env)?;
    let (_, mut recomputed, compute_rates) = fetch_phase(false, &env)?;
    for v in [&mut computed, &mut fetched, &mut recomputed] {
        v.sort_unstable();
    }
    let (compute_ms, fetch_ms) = (percentile(&recomputed, 0.5), percentile(&fetched, 0.5));
    // A prefix block of this model: 4 layers × K and V × 16 tokens × 256 floats × 4 bytes.
    let prefix_bytes = (PREFIX_TOKENS / 16 * 4 * 2 * 16 * 256 * 4) as f64;
    let fetch_phase = json!({
        "prompt_tokens": PREFIX_TOKENS + QUESTION_TOKENS,
        "prefix_bytes": prefix_bytes,
        "ttft_ms_p50": {
            "first_node_computes": percentile(&computed, 0.5),
            "second_node_computes_again": compute_ms,
            "second_node_fetches": fetch_ms,
        },
        "compute_over_fetch": compute_ms / fetch_ms,
        // Upper bounds of the time each path takes: the whole TTFT is charged to it.
        "implied_prefill_tokens_per_s": (PREFIX_TOKENS + QUESTION_TOKENS) as f64 / (compute_ms / 1e3),
        "implied_fetch_bytes_per_s": prefix_bytes / (fetch_ms / 1e3),
        // What the nodes measured of themselves (the cost model's inputs at run time).
        "node_rates_fetching": fetch_rates,
        "node_rates_computing": compute_rates,
    });
    eprintln!("fetch phase: {fetch_phase}");
    let out = json!({
        "workload": {
            "nodes": NODES, "routers": 2, "clients": CLIENTS, "tenants": TENANTS,
            "rounds": rounds, "prefix_tokens": PREFIX_TOKENS, "max_tokens": MAX_TOKENS,
            "node_kv_mib": NODE_KV_MIB,
            "model": "llama, 4 layers, hidden 256, 4 heads, intermediate 1024 (synthesized)",
        },
        "ideal_prefix_hit_ratio": ideal,
        "arms": report,
        "round_robin_over_cache_aware": {
            "ttft_p50": p50(&arms[2]) / p50(&arms[0]),
            "ttft_p99": p99(&arms[2]) / p99(&arms[0]),
        },
        "least_loaded_over_cache_aware": {
            "ttft_p50": p50(&arms[4]) / p50(&arms[0]),
            "ttft_p99": p99(&arms[4]) / p99(&arms[0]),
        },
        "round_robin_over_round_robin_with_fetch": {
            "ttft_p50": p50(&arms[2]) / p50(&arms[3]),
            "ttft_p99": p99(&arms[2]) / p99(&arms[3]),
        },
        "fetch_phase": fetch_phase,
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
