//! The cluster's request path as real processes on 127.0.0.1: three `strata node serve` (the
//! engine behind QUIC with mutual TLS from a cluster CA) and a `strata router` in front of them.
//! Greedy answers through the router equal one `strata serve` process; requests sharing a
//! prefix go where it is cached; a router without a certificate from the CA is refused; and a
//! node SIGKILLed while 32 streams run (greedy and sampled) does not break any of them: each
//! finishes with the same text as without the failure.

mod cluster;
#[path = "fuzz/mod.rs"]
mod fuzz;
#[path = "cluster_serving/hostile_peer.rs"]
mod hostile_peer;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use cluster::{
    Process, START, complete, complete_with, completion_body, document, get, metric, post,
    post_raw, post_with, send_raw, serial, spawn_stream, strata, streams_across_a_fault, synth,
};
use strata_topology::transport::ClusterCa;

/// Three nodes with member certificates, a router with an operator's; all from one CA.
struct Cluster {
    tmp: tempfile::TempDir,
    model: String,
    nodes: Vec<Process>,
    node_addrs: Vec<SocketAddr>,
    /// The first router; `None` only while the cluster is being started.
    router: Option<Process>,
    router_addr: SocketAddr,
}

impl Cluster {
    /// Another router in front of the same nodes, with the same operator identity.
    fn start_router(&self, extra: &[&str]) -> (Process, SocketAddr) {
        let list: Vec<String> = self.node_addrs.iter().map(|a| a.to_string()).collect();
        let nodes = list.join(",");
        let operator = self.tmp.path().join("router-identity");
        let mut args = vec![
            "router",
            "--model",
            &self.model,
            "--nodes",
            &nodes,
            "--identity",
            operator.to_str().unwrap(),
            "--port",
            "0",
        ];
        args.extend_from_slice(extra);
        let router = Process::start(&args);
        let addr = router.address("on http://");
        (router, addr)
    }
}

/// `strata node serve` of member `id` (its identity under `root`) on `listen`, with `extra`
/// flags.
fn spawn_node_with(root: &Path, model: &Path, id: u64, listen: &str, extra: &[&str]) -> Process {
    let identity = root.join(format!("member-{id}"));
    let mut args = vec![
        "node",
        "serve",
        "--model",
        model.to_str().unwrap(),
        "--listen",
        listen,
        "--identity",
        identity.to_str().unwrap(),
    ];
    if !extra.contains(&"--kv-cache-mib") {
        args.extend(["--kv-cache-mib", "16"]);
    }
    args.extend_from_slice(extra);
    Process::start(&args)
}

fn spawn_node(root: &Path, model: &Path, id: u64, listen: &str) -> Process {
    spawn_node_with(root, model, id, listen, &[])
}

fn start_cluster(nodes: usize) -> Cluster {
    start_cluster_with(nodes, &[])
}

/// `nodes` nodes and a router started with `router_args` added.
fn start_cluster_with(nodes: usize, router_args: &[&str]) -> Cluster {
    start_cluster_full(nodes, router_args, &[])
}

/// [`start_cluster_with`], every node started with `node_args` added.
fn start_cluster_full(nodes: usize, router_args: &[&str], node_args: &[&str]) -> Cluster {
    start_cluster_on(nodes, router_args, node_args, synth)
}

/// [`start_cluster_full`] on the model `make` writes (its directory, and so its served name,
/// `m`).
fn start_cluster_on(
    nodes: usize,
    router_args: &[&str],
    node_args: &[&str],
    make: fn(&Path),
) -> Cluster {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    make(&model);
    let ca = ClusterCa::create(&tmp.path().join("ca")).unwrap();
    let mut procs = Vec::new();
    let mut node_addrs = Vec::new();
    for id in 1..=nodes as u64 {
        ca.issue_member(id, &tmp.path().join(format!("member-{id}")))
            .unwrap();
        let node = spawn_node_with(tmp.path(), &model, id, "127.0.0.1:0", node_args);
        node_addrs.push(node.address("on quic://"));
        procs.push(node);
    }
    ca.issue_operator("router-1", &tmp.path().join("router-identity"))
        .unwrap();
    let mut cluster = Cluster {
        model: model.to_str().unwrap().to_string(),
        tmp,
        nodes: procs,
        node_addrs,
        router: None,
        router_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
    };
    let (router, addr) = cluster.start_router(router_args);
    cluster.router = Some(router);
    cluster.router_addr = addr;
    cluster
}

/// Prompts of four tenants' long shared prefixes, three questions each.
fn prompts() -> Vec<String> {
    let mut out = Vec::new();
    for tenant in 0..4 {
        let prefix = format!(
            "tenant {tenant} system prompt: {}",
            "answer briefly and exactly. ".repeat(6 + tenant)
        );
        for q in 0..3 {
            out.push(format!("{prefix} question {q}?"));
        }
    }
    out
}

#[test]
fn router_answers_like_one_process_and_routes_shared_prefixes_to_their_cache() {
    let _serial = serial();
    let cluster = start_cluster(3);
    let reference = Process::start(&["serve", "--model", &cluster.model, "--port", "0"]);
    let reference_addr = reference.address("on http://");
    for prompt in prompts() {
        let want = complete(reference_addr, &prompt, 16);
        assert!(!want.is_empty());
        assert_eq!(complete(cluster.router_addr, &prompt, 16), want, "{prompt}");
    }
    // Embeddings and rerank go through the nodes the same way: the same vectors and scores.
    let inputs = serde_json::json!({"model": "m", "input": prompts()});
    let rerank = serde_json::json!({"model": "m", "query": prompts()[0], "documents": prompts()});
    for (path, body) in [("/v1/embeddings", inputs), ("/v1/rerank", rerank)] {
        let answer = |addr| {
            let (status, text) = post(addr, path, &body.to_string());
            assert_eq!(status, 200, "{path}: {text}");
            let mut out: serde_json::Value = serde_json::from_str(&text).unwrap();
            out.as_object_mut().unwrap().remove("id");
            out
        };
        assert_eq!(
            answer(cluster.router_addr),
            answer(reference_addr),
            "{path}"
        );
    }
    // Let the KV events of the last requests reach the router (generously: a loaded machine
    // delays them), then repeat the workload: every prefix is now cached somewhere and its
    // requests go there.
    std::thread::sleep(Duration::from_secs(2));
    let (hit, by_cache) = routing_quality(cluster.router_addr);
    assert_eq!(by_cache, 12.0);
    assert!(hit > 0.9, "prefix hit ratio {hit}");
    // The ring spreads tenants over the nodes: twelve more prefixes, a request each, beside the
    // four above reach more than one node (sixteen on one node of three: odds of 1 in 10^7; the
    // four alone left it to chance, 1 in 27, as the nodes' ports place them on the ring).
    for tenant in 4..16 {
        let prompt = format!(
            "tenant {tenant} system prompt: {} question 0?",
            "answer briefly and exactly. ".repeat(6)
        );
        complete(cluster.router_addr, &prompt, 1);
    }
    let after = get(cluster.router_addr, "/metrics");
    let used = cluster
        .node_addrs
        .iter()
        .filter(|a| {
            metric(
                &after,
                &format!("strata_router_node_requests_total{{node=\"{a}\"}}"),
            ) > 0.0
        })
        .count();
    assert!(used >= 2, "{after}");
    // The Grafana dashboard under deploy/ reads only metrics a router or a server exports.
    let served = format!("{after}{}", get(reference_addr, "/metrics"));
    for name in dashboard_metrics() {
        assert!(
            served.contains(&format!("{name}{{")) || served.contains(&format!("{name} ")),
            "deploy/grafana/strata-dashboard.json reads {name}, which nothing exports"
        );
    }
    // The router shows each node's engine gauges as the node last reported them.
    for node in &cluster.node_addrs {
        let capacity = format!("strata_kv_tier_capacity_blocks{{node=\"{node}\",tier=\"device\"}}");
        assert!(metric(&after, &capacity) > 0.0, "{after}");
        let usage = format!("strata_kv_usage_ratio{{node=\"{node}\"}}");
        assert!((0.0..=1.0).contains(&metric(&after, &usage)), "{after}");
    }
}

/// A Qwen2-MoE (a shared expert, two of eight experts per token) behind two nodes and a
/// router: the three surfaces answer as one `strata serve` of the same model does.
#[test]
fn a_mixture_of_experts_through_a_router_answers_each_surface_as_one_process() {
    let _serial = serial();
    let cluster = start_cluster_on(2, &[], &[], |dir| {
        let out = strata(&[
            "model",
            "synth",
            "--arch",
            "qwen2_moe",
            "--out",
            dir.to_str().unwrap(),
            "--layers",
            "2",
            "--hidden",
            "64",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--intermediate",
            "128",
            "--expert-intermediate",
            "32",
            "--experts",
            "8",
            "--experts-per-token",
            "2",
            "--shared-expert-intermediate",
            "48",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    });
    let reference = Process::start(&["serve", "--model", &cluster.model, "--port", "0"]);
    let reference_addr = reference.address("on http://");
    for prompt in prompts().iter().take(3) {
        let want = complete(reference_addr, prompt, 16);
        assert!(!want.is_empty());
        assert_eq!(complete(cluster.router_addr, prompt, 16), want, "{prompt}");
    }
    let user = serde_json::json!([{"role": "user", "content": "name three colors"}]);
    let surfaces = [
        (
            "/v1/chat/completions",
            serde_json::json!({"model": "m", "max_tokens": 12, "temperature": 0, "messages": user}),
            "/choices/0/message/content",
        ),
        (
            "/v1/messages",
            serde_json::json!({"model": "m", "max_tokens": 12, "temperature": 0, "messages": user}),
            "/content/0/text",
        ),
        (
            "/model/m/converse",
            serde_json::json!({"messages": [{"role": "user", "content": [{"text": "name three colors"}]}],
                "inferenceConfig": {"maxTokens": 12, "temperature": 0}}),
            "/output/message/content/0/text",
        ),
    ];
    for (path, body, text) in surfaces {
        let answer = |addr| {
            let (status, out) = post(addr, path, &body.to_string());
            assert_eq!(status, 200, "{path}: {out}");
            let v: serde_json::Value = serde_json::from_str(&out).unwrap();
            v.pointer(text)
                .and_then(serde_json::Value::as_str)
                .unwrap_or_else(|| panic!("{path}: no text at {text}: {out}"))
                .to_string()
        };
        let want = answer(reference_addr);
        assert!(!want.is_empty(), "{path}");
        assert_eq!(answer(cluster.router_addr), want, "{path}");
    }
}

/// Requests in flight when every node dies end as a new request would at that moment: 503 with
/// Retry-After, promptly (not after the failover wait, not as a 500).
#[test]
fn requests_in_flight_when_every_node_dies_end_promptly_as_503_with_retry_after() {
    let _serial = serial();
    let mut cluster = start_cluster(2);
    let router = cluster.router_addr;
    let handles: Vec<_> = (0..8)
        .map(|i| {
            let body = completion_body(
                &format!("request {i}: tell a long story"),
                3500,
                false,
                None,
            );
            std::thread::spawn(move || send_raw(router, "POST", "/v1/completions", &body))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    for node in &mut cluster.nodes {
        node.kill();
    }
    let killed = std::time::Instant::now();
    let answers: Vec<String> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let waited = killed.elapsed();
    let status = |raw: &str| raw.split(' ').nth(1).unwrap_or("").to_string();
    let unavailable: Vec<&String> = answers.iter().filter(|a| status(a) == "503").collect();
    for answer in &answers {
        assert!(
            ["200", "503"].contains(&status(answer).as_str()),
            "an in-flight request ended otherwise: {answer}"
        );
    }
    assert!(
        !unavailable.is_empty(),
        "no request was in flight at the kill"
    );
    for answer in unavailable {
        assert!(
            answer.to_ascii_lowercase().contains("\r\nretry-after: "),
            "{answer}"
        );
    }
    assert!(
        waited < Duration::from_secs(15),
        "they ended {waited:?} after the kill"
    );
    // A new request now is told the same at once.
    let (status, body) = post(
        router,
        "/v1/completions",
        &completion_body("new", 4, false, None),
    );
    assert_eq!(status, 503, "{body}");
}

/// Every `strata_…` and `process_…` metric name the Grafana dashboard's queries read.
fn dashboard_metrics() -> std::collections::BTreeSet<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/grafana/strata-dashboard.json");
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut names = std::collections::BTreeSet::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            for prefix in ["strata_", "process_"] {
                for (at, _) in expr.match_indices(prefix) {
                    let name: String = expr[at..]
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    names.insert(name);
                }
            }
        }
    }
    assert!(names.len() > 20, "{names:?}");
    names
}

/// Runs `prompts()` through `addr` and returns the share of its prompt blocks found cached on
/// the node each request went to, and the requests routed by cache.
fn routing_quality(addr: SocketAddr) -> (f64, f64) {
    let before = get(addr, "/metrics");
    for prompt in prompts() {
        complete(addr, &prompt, 4);
    }
    let after = get(addr, "/metrics");
    let delta = |name: &str| metric(&after, name) - metric(&before, name);
    let hit =
        delta("strata_router_cached_blocks_total") / delta("strata_router_prompt_blocks_total");
    (
        hit,
        delta("strata_router_decisions_total{reason=\"cache\"}"),
    )
}

#[test]
fn a_second_router_and_a_restarted_one_route_by_the_nodes_caches_at_once() {
    let _serial = serial();
    let mut cluster = start_cluster(3);
    for prompt in prompts() {
        complete(cluster.router_addr, &prompt, 4);
    }
    std::thread::sleep(Duration::from_secs(2));
    // A second router, active beside the first: its index comes from the nodes' dumps, so its
    // very first requests go where their prefixes are cached.
    let (_second, second) = cluster.start_router(&[]);
    let (hit, by_cache) = routing_quality(second);
    assert!(hit > 0.9, "a new router's prefix hit ratio: {hit}");
    assert_eq!(by_cache, 12.0);
    // The first router SIGKILLed and restarted: the same.
    if let Some(router) = cluster.router.as_mut() {
        router.kill();
    }
    let (_restarted, restarted) = cluster.start_router(&[]);
    let (hit, by_cache) = routing_quality(restarted);
    assert!(hit > 0.9, "a restarted router's prefix hit ratio: {hit}");
    assert_eq!(by_cache, 12.0);
}

#[test]
fn a_router_without_a_certificate_from_the_ca_is_refused() {
    let _serial = serial();
    let cluster = start_cluster(1);
    let tmp = tempfile::tempdir().unwrap();
    let other = ClusterCa::create(&tmp.path().join("ca")).unwrap();
    other
        .issue_operator("intruder", &tmp.path().join("id"))
        .unwrap();
    let out = strata(&[
        "router",
        "--model",
        &cluster.model,
        "--nodes",
        &cluster.node_addrs[0].to_string(),
        "--identity",
        tmp.path().join("id").to_str().unwrap(),
        "--port",
        "0",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot reach node"), "{stderr}");
}

#[test]
fn a_router_with_no_reachable_node_is_not_ready_and_answers_503_with_retry_after() {
    let _serial = serial();
    let mut cluster = start_cluster(1);
    let ready = get(cluster.router_addr, "/ready");
    assert!(ready.starts_with("HTTP/1.1 200"), "{ready}");
    cluster.nodes[0].kill();
    // The router notices the node's connection is gone (QUIC's idle timeout at the latest).
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let not_ready = loop {
        let ready = get(cluster.router_addr, "/ready");
        if ready.starts_with("HTTP/1.1 503") {
            break ready;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still ready with its only node killed: {ready}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let lower = not_ready.to_ascii_lowercase();
    assert!(lower.contains("retry-after: 1"), "{not_ready}");
    assert!(not_ready.contains("no node is reachable"), "{not_ready}");
    // Every surface refuses before any stream starts: 503, Retry-After, its own error shape.
    let chat = |stream: bool| {
        format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"hi"}}],"max_tokens":4,"stream":{stream}}}"#
        )
    };
    // The served name is the checkpoint directory's.
    let messages =
        r#"{"model":"m","max_tokens":4,"stream":true,"messages":[{"role":"user","content":"hi"}]}"#
            .to_string();
    for (path, body, shape) in [
        ("/v1/chat/completions", chat(false), r#""error":{"#),
        ("/v1/chat/completions", chat(true), r#""error":{"#),
        ("/v1/messages", messages, r#""type":"error""#),
    ] {
        let raw = post_raw(cluster.router_addr, path, &body);
        assert!(raw.starts_with("HTTP/1.1 503"), "{path}: {raw}");
        assert!(
            raw.to_ascii_lowercase().contains("retry-after: 1"),
            "{path}: {raw}"
        );
        assert!(raw.contains(shape), "{path}: {raw}");
        assert!(raw.contains("no node is reachable"), "{path}: {raw}");
    }
}

#[test]
fn a_router_takes_admission_limits_and_refuses_beyond_them_with_429() {
    let _serial = serial();
    let cluster = start_cluster_with(1, &["--max-inflight", "1", "--max-queued", "0"]);
    // One long stream holds the only slot (its client reads the first chunk, then nothing).
    let mut first = TcpStream::connect(cluster.router_addr).expect("connect");
    first
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let body =
        r#"{"model":"m","prompt":"hello","max_tokens":1500,"ignore_eos":true,"stream":true}"#;
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    first.write_all(request.as_bytes()).unwrap();
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(&head).contains("data: ") {
        let n = first.read(&mut buf).unwrap();
        assert!(n > 0, "{}", String::from_utf8_lossy(&head));
        head.extend_from_slice(&buf[..n]);
    }
    assert!(head.starts_with(b"HTTP/1.1 200"));
    // A second request finds no slot and no queue: 429 with Retry-After, at once.
    let second = post_raw(
        cluster.router_addr,
        "/v1/completions",
        r#"{"model":"m","prompt":"hello","max_tokens":2}"#,
    );
    assert!(second.starts_with("HTTP/1.1 429"), "{second}");
    assert!(
        second.to_ascii_lowercase().contains("retry-after: 1"),
        "{second}"
    );
    assert!(second.contains("1 requests running, 0 waiting"), "{second}");
    // A zero running limit is refused at startup, by name.
    let out = strata(&[
        "router",
        "--model",
        &cluster.model,
        "--nodes",
        &cluster.node_addrs[0].to_string(),
        "--max-inflight",
        "0",
        "--port",
        "0",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--max-inflight"), "{stderr}");
}

/// Nodes refuse generate calls beyond `--max-requests` as busy; the router sends them to the
/// other node or, when both are full, tries again after a pause, so every request completes
/// equal to the fault-free run. The canary: without the limit no call is refused busy.
#[test]
fn nodes_hold_their_admission_limit_and_the_router_places_the_rest() {
    let _serial = serial();
    let run = |node_args: &[&str]| -> (Vec<bool>, f64) {
        let cluster = start_cluster_full(2, &[], node_args);
        let reference = Process::start(&["serve", "--model", &cluster.model, "--port", "0"]);
        let reference_addr = reference.address("on http://");
        let prompts: Vec<String> = (0..6).map(|i| format!("admission {i}: tell")).collect();
        let want: Vec<String> = prompts
            .iter()
            .map(|p| complete_with(reference_addr, p, 300, None))
            .collect();
        let router = cluster.router_addr;
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let p = p.clone();
                std::thread::spawn(move || complete_with(router, &p, 300, None))
            })
            .collect();
        let same = handles
            .into_iter()
            .zip(&want)
            .map(|(h, want)| h.join().ok().is_some_and(|got| &got == want))
            .collect();
        let busy = metric(
            &get(router, "/metrics"),
            "strata_router_busy_refusals_total",
        );
        (same, busy)
    };
    let (same, busy) = run(&["--max-requests", "1"]);
    assert!(
        same.iter().all(|&s| s),
        "answers equal to one process: {same:?}"
    );
    assert!(
        busy >= 1.0,
        "six requests on two nodes holding one each: no busy refusal"
    );
    let (same, busy) = run(&[]);
    assert!(same.iter().all(|&s| s), "{same:?}");
    assert_eq!(
        busy, 0.0,
        "a node without a limit of its own refused as busy"
    );
    // A zero limit is refused at startup, by name.
    let out = strata(&[
        "node",
        "serve",
        "--model",
        "unused",
        "--identity",
        "unused",
        "--max-requests",
        "0",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--max-requests"), "{stderr}");
}

/// Runs 32 streams (even ones greedy, odd ones sampled with a seed and penalties) through a
/// router started with `router_args`, SIGKILLs one of the three nodes once every stream has its
/// first text, and returns, per stream, whether it ended with the fault-free run's text, and the
/// router's metrics.
fn streams_across_a_node_kill(router_args: &[&str]) -> (Vec<bool>, String) {
    streams_across_a_node_fault(router_args, &[], "KILL")
}

/// [`streams_across_a_node_kill`] with the node sent `signal` instead: `STOP` leaves it hung,
/// its connection silent, for the router to notice by the connection's idle timeout. The nodes
/// take `node_args`; the fault-free reference is a plain `strata serve`.
fn streams_across_a_node_fault(
    router_args: &[&str],
    node_args: &[&str],
    signal: &str,
) -> (Vec<bool>, String) {
    let cluster = start_cluster_full(3, router_args, node_args);
    let reference = Process::start(&["serve", "--model", &cluster.model, "--port", "0"]);
    let reference_addr = reference.address("on http://");
    let kill = || {
        let pid = cluster.nodes[0].child.id().to_string();
        let sent = std::process::Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .unwrap();
        assert!(sent.success());
    };
    let same = streams_across_a_fault(
        cluster.router_addr,
        reference_addr,
        ("stream", 32, 1000),
        kill,
    );
    (same, get(cluster.router_addr, "/metrics"))
}

#[test]
fn a_rolling_restart_of_every_node_under_long_streams_ends_none_of_them() {
    let _serial = serial();
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let mut cluster = start_cluster(2);
    let reference = Process::start(&["serve", "--model", &cluster.model, "--port", "0"]);
    let reference_addr = reference.address("on http://");
    const TOKENS: u32 = 3000;
    let prompts: Vec<String> = (0..16).map(|i| format!("rolling {i}: once upon")).collect();
    let want: Vec<String> = prompts
        .iter()
        .map(|p| complete_with(reference_addr, p, TOKENS, None))
        .collect();
    let finished = Arc::new(AtomicUsize::new(0));
    let (started_tx, started) = mpsc::channel();
    let handles: Vec<_> = prompts
        .iter()
        .map(|prompt| {
            let body = completion_body(prompt, TOKENS, true, None);
            spawn_stream(
                cluster.router_addr,
                body,
                started_tx.clone(),
                finished.clone(),
            )
        })
        .collect();
    for _ in 0..prompts.len() {
        started.recv_timeout(START).expect("every stream starts");
    }
    // Node 1 SIGKILLed and restarted on its address; then node 2 SIGKILLed. A stream that has
    // lost node 1 and then node 2 continues on node 1's new incarnation (it used to fail with
    // "no node could finish": one try per node for a stream's whole life).
    let model = Path::new(&cluster.model).to_path_buf();
    let first = cluster.node_addrs[0];
    cluster.nodes[0].kill();
    cluster.nodes[0] = spawn_node(cluster.tmp.path(), &model, 1, &first.to_string());
    std::thread::sleep(Duration::from_millis(500));
    let running = prompts.len() - finished.load(Ordering::Relaxed);
    cluster.nodes[1].kill();
    assert!(running > 0, "every stream ended before the second kill");
    let same: Vec<bool> = handles
        .into_iter()
        .zip(&want)
        .map(|(h, want)| h.join().ok().is_some_and(|got| &got == want))
        .collect();
    assert!(
        same.iter().all(|&s| s),
        "streams equal to the fault-free run: {same:?}"
    );
    let failovers = metric(
        &get(cluster.router_addr, "/metrics"),
        "strata_router_failovers_total",
    );
    assert!(
        failovers >= running as f64,
        "{failovers} failovers, {running} streams running"
    );
}

/// Every one of the 32 streams survives `signal` sent to a node, and some failed over.
fn assert_streams_survive(signal: &str) {
    assert_streams_survive_on(&[], signal);
}

/// [`assert_streams_survive`] with every node started with `node_args`.
fn assert_streams_survive_on(node_args: &[&str], signal: &str) {
    let (same, metrics) = streams_across_a_node_fault(&[], node_args, signal);
    let broken: Vec<usize> = (0..same.len()).filter(|&i| !same[i]).collect();
    assert!(
        broken.is_empty(),
        "streams {broken:?} differ from the fault-free run (SIG{signal})"
    );
    assert!(
        metric(&metrics, "strata_router_failovers_total") >= 1.0,
        "no stream was on the node sent SIG{signal}?\n{metrics}"
    );
}

#[test]
fn sigkill_of_a_node_under_32_streams_breaks_none_of_them() {
    let _serial = serial();
    assert_streams_survive("KILL");
}

/// Speculating nodes (n-gram, k = 4), one SIGKILLed mid-stream: every stream continues on
/// another node and ends with the text of a plain, fault-free `strata serve` — the greedy and the
/// seeded sampled ones alike (the run-spec gate's failover arm).
#[test]
fn sigkill_of_a_speculating_node_under_32_streams_matches_plain_decoding() {
    let _serial = serial();
    assert_streams_survive_on(
        &[
            "--speculative-config",
            r#"{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}"#,
        ],
        "KILL",
    );
}

#[test]
fn a_hung_node_under_32_streams_breaks_none_of_them() {
    let _serial = serial();
    assert_streams_survive("STOP");
}

#[test]
fn canary_without_failover_the_same_kill_breaks_streams() {
    let _serial = serial();
    let (same, _) = streams_across_a_node_kill(&["--failover", "false"]);
    assert!(
        same.iter().any(|s| !s),
        "every stream survived a node kill with failover off: the kill came too late"
    );
}

#[test]
fn nodes_that_come_up_late_or_come_back_get_traffic_and_no_request_fails() {
    let _serial = serial();
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let mut cluster = start_cluster(2);
    // A third node the router knows of but which is not up yet.
    let late = SocketAddr::from(([127, 0, 0, 1], cluster::free_ports(1)));
    cluster.node_addrs.push(late);
    let ca = ClusterCa::load(&cluster.tmp.path().join("ca")).unwrap();
    ca.issue_member(3, &cluster.tmp.path().join("member-3"))
        .unwrap();
    let (_router, router) = cluster.start_router(&["--policy", "round-robin"]);
    let requests_to = |node: SocketAddr| {
        let text = get(router, "/metrics");
        metric(
            &text,
            &format!("strata_router_node_requests_total{{node=\"{node}\"}}"),
        )
    };
    // Load: four clients sending requests until told to stop; every answer must be a 200.
    let stop = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(AtomicUsize::new(0));
    let sent = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..4)
        .map(|c| {
            let (stop, failed, sent) = (stop.clone(), failed.clone(), sent.clone());
            std::thread::spawn(move || {
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let body = completion_body(&format!("client {c} request {i}"), 24, false, None);
                    let (status, body) = cluster::post(router, "/v1/completions", &body);
                    if status != 200 {
                        eprintln!("request failed: {status} {body}");
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                    sent.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            })
        })
        .collect();
    let wait_for = |what: &str, cond: &dyn Fn() -> bool| {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while !cond() {
            assert!(std::time::Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    wait_for("load before the late node", &|| {
        sent.load(Ordering::Relaxed) >= 8
    });
    assert_eq!(requests_to(late), 0.0);
    let model = Path::new(&cluster.model).to_path_buf();
    let _third = spawn_node(cluster.tmp.path(), &model, 3, &late.to_string());
    wait_for("the late node gets traffic", &|| requests_to(late) > 0.0);
    // The first node SIGKILLed under load and restarted on its address: traffic again.
    let first = cluster.node_addrs[0];
    cluster.nodes[0].kill();
    let before = requests_to(first);
    std::thread::sleep(Duration::from_millis(500));
    cluster.nodes[0] = spawn_node(cluster.tmp.path(), &model, 1, &first.to_string());
    wait_for("the restarted node gets traffic", &|| {
        requests_to(first) > before + 2.0
    });
    stop.store(true, Ordering::Relaxed);
    for client in clients {
        client.join().unwrap();
    }
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "requests failed under the changes"
    );
}

/// The text, prompt tokens and cached prompt tokens of a greedy completion through `addr`.
fn complete_cached(addr: SocketAddr, prompt: &str, max_tokens: u32) -> (String, u64, u64) {
    let body = completion_body(prompt, max_tokens, false, None);
    let (status, body) = post(addr, "/v1/completions", &body);
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    let usage = &v["usage"];
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    (text, usage["prompt_tokens"].as_u64().unwrap(), cached)
}

/// Round-robin sends the second request of a long prompt to the node that has not seen it;
/// with fetching on, that node imports the prompt's KV blocks from the node that computed them
/// (over QUIC, with its member certificate). Returns the prompt's tokens, the second request's
/// cached prompt tokens and the fetches the router asked for.
fn fetch_round(router_args: &[&str]) -> (u64, u64, f64) {
    let mut args = vec!["--policy", "round-robin"];
    args.extend_from_slice(router_args);
    let cluster = start_cluster_with(2, &args);
    let prompt = format!(
        "a long shared context: {} and then the question?",
        "every block of this prompt is worth keeping. ".repeat(40)
    );
    let (first, _, cached_first) = complete_cached(cluster.router_addr, &prompt, 8);
    assert_eq!(cached_first, 0, "a cold cluster has nothing cached");
    // Let the first node's KV events reach the router.
    std::thread::sleep(Duration::from_secs(2));
    let (second, prompt_tokens, cached) = complete_cached(cluster.router_addr, &prompt, 8);
    assert_eq!(second, first, "the same greedy text, fetched KV or not");
    // Let a load report (every 50 ms) carry the nodes' rates.
    std::thread::sleep(Duration::from_millis(300));
    let metrics = get(cluster.router_addr, "/metrics");
    let per_node: Vec<f64> = cluster
        .node_addrs
        .iter()
        .map(|a| {
            metric(
                &metrics,
                &format!("strata_router_node_requests_total{{node=\"{a}\"}}"),
            )
        })
        .collect();
    assert_eq!(per_node, vec![1.0, 1.0], "round-robin used both nodes");
    // The nodes report what they measured: the first its compute rate (it prefilled the
    // prompt); the second its fetch's throughput if it fetched, else its compute rate.
    let rate = |name: &str, node: SocketAddr| {
        metric(
            &metrics,
            &format!("strata_router_node_{name}{{node=\"{node}\"}}"),
        )
    };
    let fetches = metric(&metrics, "strata_router_kv_fetches_total");
    let [a, b] = [cluster.node_addrs[0], cluster.node_addrs[1]];
    assert!(rate("tokens_per_second", a) > 0.0, "{metrics}");
    let measured = if fetches > 0.0 {
        rate("fetch_bytes_per_second", b)
    } else {
        rate("tokens_per_second", b)
    };
    assert!(measured > 0.0, "{metrics}");
    (prompt_tokens, cached, fetches)
}

#[test]
fn a_node_fetches_a_prefix_cached_on_another_instead_of_computing_it() {
    let _serial = serial();
    let (prompt, cached, fetches) = fetch_round(&[]);
    assert_eq!(fetches, 1.0);
    // Every full block of the prompt arrives (the last token is always computed, for logits).
    assert!(
        cached + 2 * 16 > prompt && cached > 0,
        "{cached} of {prompt} prompt tokens cached on the second node"
    );
    // Canary: without fetching, the second node computes everything.
    let (_, cached, fetches) = fetch_round(&["--kv-fetch", "false"]);
    assert_eq!((cached, fetches), (0, 0.0));
}

/// A conversation over a long document through a router with two nodes whose devices hold 128
/// blocks and whose host tiers hold 512: between turns other documents push the conversation's
/// prefix off its node's device, and each later turn is routed to that node (the KV events name
/// the tier that holds it), restores the prefix from host memory (reported as cached tokens) and
/// answers as one cold process does. The canary: without host tiers the same turns find nothing
/// cached.
#[test]
fn a_conversation_over_a_parked_document_is_restored_from_its_nodes_host_tier() {
    let _serial = serial();
    let cached = parked_conversation(&["--kv-cache-mib", "1", "--kv-host-mib", "4"]);
    assert!(
        cached[1..].iter().all(|&c| c >= 640),
        "every later turn restores the document from its node's host tier: {cached:?}"
    );
    let cached = parked_conversation(&["--kv-cache-mib", "1"]);
    assert!(
        cached[1..].iter().all(|&c| c < 640),
        "the canary: without host tiers the document was evicted: {cached:?}"
    );
}

/// Three turns over one document through two nodes started with `node_args`, other documents
/// filling both devices twice over between turns; each turn's answer equals one cold process's.
/// Returns each turn's cached prompt tokens.
fn parked_conversation(node_args: &[&str]) -> Vec<u64> {
    let cluster = start_cluster_full(2, &[], node_args);
    let reference = Process::start(&["serve", "--model", &cluster.model, "--port", "0"]);
    let reference_addr = reference.address("on http://");
    let chat = |addr: SocketAddr, messages: &[serde_json::Value]| {
        let body = serde_json::json!({
            "model": "m", "messages": messages, "max_tokens": 8, "temperature": 0,
        });
        let (status, answer) = post(addr, "/v1/chat/completions", &body.to_string());
        assert_eq!(status, 200, "{answer}");
        let v: serde_json::Value = serde_json::from_str(&answer).unwrap();
        let text = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        (text, cached)
    };
    let mut messages = vec![serde_json::json!({"role": "system", "content": document(0)})];
    let mut cached_by_turn = Vec::new();
    let mut pushed = 0;
    for turn in 0..3 {
        messages.push(serde_json::json!({
            "role": "user", "content": format!("what does note 0 {turn} hold?"),
        }));
        let (answer, cached) = chat(cluster.router_addr, &messages);
        let (cold, _) = chat(reference_addr, &messages);
        assert_eq!(answer, cold, "turn {turn} answers as one cold process");
        cached_by_turn.push(cached);
        messages.push(serde_json::json!({"role": "assistant", "content": answer}));
        for _ in 0..8 {
            pushed += 1;
            complete(cluster.router_addr, &document(pushed), 1);
        }
        // Let the nodes' KV events (the document's move to host) reach the router.
        std::thread::sleep(Duration::from_millis(500));
    }
    cached_by_turn
}

/// SIGTERM drains a node: the stream it is running finishes there (equal to one process's
/// text), new requests go to the other node meanwhile, and before exiting the node writes its
/// cached KV to its disk tier; started again on the same directory it serves the document from
/// disk (cached tokens reported, the same text as cold).
#[test]
fn sigterm_drains_a_node_and_parks_its_cache_on_disk_for_its_restart() {
    let _serial = serial();
    let tmp = tempfile::tempdir().unwrap();
    let disk = tmp.path().join("kv");
    let disk = disk.to_str().unwrap();
    let node_args = ["--kv-disk-dir", disk, "--kv-disk-mib", "64"];
    let mut cluster = start_cluster_full(1, &[], &node_args);
    let reference = Process::start(&["serve", "--model", &cluster.model, "--port", "0"]);
    let reference_addr = reference.address("on http://");
    let document = document(0);
    let want = complete(reference_addr, &document, 8);
    assert_eq!(complete(cluster.router_addr, &document, 8), want);

    // A long stream in flight when SIGTERM arrives finishes on the draining node.
    let long = "drain: once upon";
    let long_want = complete_with(reference_addr, long, 3000, None);
    let finished = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (started_tx, started) = mpsc::channel();
    let stream = spawn_stream(
        cluster.router_addr,
        completion_body(long, 3000, true, None),
        started_tx,
        finished.clone(),
    );
    started.recv_timeout(START).expect("the stream starts");
    let pid = cluster.nodes[0].child.id().to_string();
    let term = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(term.success());
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        finished.load(std::sync::atomic::Ordering::Relaxed),
        0,
        "the stream was still running when the node was told to stop"
    );
    assert_eq!(
        stream.join().unwrap(),
        long_want,
        "the drained stream's text"
    );
    let failovers = metric(
        &get(cluster.router_addr, "/metrics"),
        "strata_router_failovers_total",
    );
    assert_eq!(
        failovers, 0.0,
        "it finished on the draining node, not by failover"
    );
    let status = cluster.nodes[0].child.wait().unwrap();
    assert!(
        status.success(),
        "the node exits cleanly after draining: {status}"
    );
    let parked = std::fs::read_dir(disk)
        .unwrap()
        .flatten()
        .flat_map(|d| std::fs::read_dir(d.path()).unwrap().flatten())
        .count();
    assert!(
        parked >= 40,
        "the node parked its cache on disk: {parked} blocks"
    );

    let model = Path::new(&cluster.model).to_path_buf();
    let addr = cluster.node_addrs[0].to_string();
    cluster.nodes[0] = spawn_node_with(cluster.tmp.path(), &model, 1, &addr, &node_args);
    let body = serde_json::json!({
        "model": "m", "prompt": document, "max_tokens": 8, "temperature": 0, "ignore_eos": true,
    });
    let deadline = std::time::Instant::now() + START;
    let answer = loop {
        let (status, answer) = post(cluster.router_addr, "/v1/completions", &body.to_string());
        if status == 200 {
            break answer;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the restarted node never answered"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let v: serde_json::Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(
        v["choices"][0]["text"],
        want.as_str(),
        "restored from disk equals cold"
    );
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    assert!(
        cached >= 640,
        "the document restored from the parked disk tier: {cached}"
    );
}

/// `/v1/cache` through a router: the context is primed where the router places it and pinned
/// on the node holding it, so traffic that evicts an unprimed prompt of the same size (the
/// canary) leaves it cached there; it is listed with its blocks, restored for a later request
/// (cached tokens, the cold text) and deleted. An Anthropic `cache_control` mark pins the same
/// way through the router.
#[test]
fn a_context_primed_through_a_router_is_pinned_on_its_node() {
    let _serial = serial();
    let cluster = start_cluster_full(2, &[], &["--kv-cache-mib", "1"]);
    let reference = Process::start(&["serve", "--model", &cluster.model, "--port", "0"]);
    let reference_addr = reference.address("on http://");
    let call = |method: &str, path: &str, body: serde_json::Value| {
        let (status, answer) = post_with(cluster.router_addr, method, path, &body.to_string());
        let v: serde_json::Value = serde_json::from_str(&answer).unwrap_or_default();
        (status, v)
    };
    let (status, primed) = call(
        "POST",
        "/v1/cache",
        serde_json::json!({"prompt": document(0), "ttl_seconds": 600}),
    );
    assert_eq!(status, 200, "{primed}");
    let id = primed["id"].as_str().unwrap().to_string();
    let pinned = primed["cached_tokens"].as_u64().unwrap();
    assert!(pinned >= 640, "{primed}");
    // The canary, computed but not primed; then traffic filling both devices twice over.
    complete(cluster.router_addr, &document(9), 1);
    for topic in 1..=8 {
        complete(cluster.router_addr, &document(topic), 1);
    }
    std::thread::sleep(Duration::from_millis(500));
    let ask = |prompt: &str| {
        let body = completion_body(prompt, 6, false, None);
        let (status, answer) = post(cluster.router_addr, "/v1/completions", &body);
        assert_eq!(status, 200, "{answer}");
        let v: serde_json::Value = serde_json::from_str(&answer).unwrap();
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
        (v["choices"][0]["text"].clone(), cached.unwrap_or(0))
    };
    let question = |topic: usize| format!("{}; and note {topic} 3?", document(topic));
    let (text, cached) = ask(&question(0));
    assert!(
        cached >= pinned,
        "the primed context stayed on its node: {cached} < {pinned}"
    );
    assert_eq!(text, complete(reference_addr, &question(0), 6).as_str());
    let (_, cached) = ask(&question(9));
    assert!(
        cached < 640,
        "the canary was evicted by the same traffic: {cached}"
    );

    let (status, list) = call("GET", "/v1/cache", serde_json::Value::Null);
    assert_eq!(status, 200, "{list}");
    assert_eq!(list["data"][0]["id"], id.as_str(), "{list}");
    assert_eq!(
        list["data"][0]["cached_tokens"].as_u64(),
        Some(pinned),
        "{list}"
    );
    let path = format!("/v1/cache/{id}");
    let (status, deleted) = call("DELETE", &path, serde_json::Value::Null);
    assert_eq!(
        (status, &deleted["deleted"]),
        (200, &serde_json::json!(true))
    );
    let (status, _) = call("GET", &path, serde_json::Value::Null);
    assert_eq!(status, 404);

    // A cache_control mark parks the marked system prompt on its node the same way.
    let message = |question: &str| {
        serde_json::json!({
            "model": "m", "max_tokens": 4, "temperature": 0,
            "system": [{"type": "text", "text": document(20),
                        "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
            "messages": [{"role": "user", "content": question}],
        })
    };
    let (status, first) = call("POST", "/v1/messages", message("note 20 1?"));
    assert_eq!(status, 200, "{first}");
    let written = first["usage"]["cache_creation_input_tokens"]
        .as_u64()
        .unwrap();
    assert!(written >= 640, "{first}");
    std::thread::sleep(Duration::from_millis(300));
    for topic in 21..=28 {
        complete(cluster.router_addr, &document(topic), 1);
    }
    std::thread::sleep(Duration::from_millis(500));
    let (status, second) = call("POST", "/v1/messages", message("note 20 2?"));
    assert_eq!(status, 200, "{second}");
    let read = second["usage"]["cache_read_input_tokens"].as_u64().unwrap();
    assert!(
        read >= written,
        "the marked prefix stayed cached on its node: {second}"
    );
}

/// Mutated calls from an authenticated but hostile peer (`cluster_serving/hostile_peer.rs`).
#[test]
fn mutated_calls_from_an_authenticated_peer_leave_the_node_serving() {
    let _serial = serial();
    let campaign = fuzz::Campaign::new("node calls", 0x40d_0001, 1_500, Duration::from_secs(20));
    let report = hostile_peer::campaign(campaign);
    for outcome in ["answered", "refused"] {
        assert!(report.count(outcome) > 0, "no call {outcome}: {report:?}");
    }
}

#[test]
#[ignore = "a recorded ten-minute run: scripts/fuzz-long.sh"]
fn node_calls_for_ten_minutes() {
    let _serial = serial();
    hostile_peer::campaign(fuzz::Campaign::new("node calls", 0x40d_1001, 0, Duration::ZERO).long());
}
